"""strata.torch on a GPU (issue 12: the package's GPU path).

GpuTest: a model on cuda:0 trained through strata.torch.initialize (the
engine's CUDA backend, parameters and optimizer state on NVMe in a temporary
directory) against the same model trained on the GPU by torch.optim.AdamW on
the same batches: test_torch_engine's key cases with its tolerances (losses
within 1e-5 relative, |strata - torch| / |torch update| over all weights
<= 1e-4). TF32 is off (torch.backends.cuda.matmul.allow_tf32 = False) and
attention is "eager" (deterministic kernels), so fp32 matches to ~1e-5. Also:
bf16/fp16 compute, tied embeddings with prefetch_depth 0 and released buffers
poisoned, activation checkpointing, PEFT LoRA, streams (a micro-batch under
another stream; a stream change while groups are held refused), the device
budget, StrataTrainer on the GPU against transformers.Trainer.
They need CUDA and a libstrata with its CUDA module: skipped without, and
FAILED instead under STRATA_REQUIRE_GPU=1 (tools/gpu_check.sh and ctest
python_package_gpu set it).

SimulatedCudaTest: the GPU path's Python logic (stream wrapping, caching and
switching, the refusal, the device budget, every engine call inside the
device context and without a host synchronize after acquire) run on the
host backend with the CUDA calls replaced by stand-ins. Runs everywhere; it
checks the package's control flow, not CUDA.
"""
import contextlib
import copy
import importlib.util
import json
import os
import shutil
import tempfile
import unittest
from unittest import mock

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import strata.torch as st
import strata.torch.engine as st_engine
from strata import StrataError, _lib
from test_torch_engine import LOSS_TOL, VOCAB, WEIGHT_TOL, batches, ds_config, llama, strata_run, torch_run

REQUIRE_GPU = os.environ.get("STRATA_REQUIRE_GPU") == "1"
DEV = torch.device("cuda", 0)
GiB = 1 << 30


def llama_eager(tied=False, layers=2):
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                        tie_word_embeddings=tied, initializer_range=0.1,
                                        attn_implementation="eager"))


def on_gpu(data):
    return [x.to(DEV) for x in data]


def cpu_state(model):
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


_why_not = None


def gpu_unavailable():
    """Why the GPU path cannot run here ("" when it can): no CUDA device, or a
    library without a usable CUDA backend (an engine on cuda:0 is refused as
    UNAVAILABLE). Any other failure of the probe is an error of its own."""
    global _why_not
    if _why_not is None:
        if not torch.cuda.is_available():
            _why_not = "torch sees no CUDA device"
        else:
            try:
                e, _, _, _ = st.initialize(model=torch.nn.Linear(4, 4).to(DEV), config={})
                e.destroy()
                _why_not = ""
            except StrataError as ex:
                if ex.status != "UNAVAILABLE":
                    raise
                _why_not = f"the Strata library ({_lib.library_path()}) has no usable CUDA backend: {ex}"
    return _why_not


class GpuTest(unittest.TestCase):
    def setUp(self):
        why = gpu_unavailable()
        if why:
            if REQUIRE_GPU:
                self.fail(f"STRATA_REQUIRE_GPU=1 but the GPU path cannot run: {why}")
            self.skipTest(why)
        self.tf32 = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        self.dir = tempfile.mkdtemp(prefix="strata-torch-gpu-test-", dir=os.environ.get("STRATA_TEST_DIR"))

    def tearDown(self):
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = self.tf32
        shutil.rmtree(self.dir, ignore_errors=True)

    def nvme(self, name="nvme"):
        d = os.path.join(self.dir, name)
        os.makedirs(d, exist_ok=True)
        return d

    def compare(self, what, ref_model, init, sd, l_strata, l_torch):
        self.assertEqual(len(l_strata), len(l_torch))
        err = max(abs(a - b) / abs(b) for a, b in zip(l_strata, l_torch))
        self.assertLessEqual(err, LOSS_TOL, f"{what}: losses {l_strata} vs {l_torch}")
        num = den = 0.0
        for k, w in ref_model.state_dict().items():
            w = w.detach().cpu().double()
            num += (sd[k].double() - w).norm().item() ** 2
            den += (w - init[k].double()).norm().item() ** 2
        ratio = num ** 0.5 / den ** 0.5
        print(f"  {what}: {len(l_strata)} micro-batches, losses within {err:.1e}, weights |diff| / |update| = "
              f"{ratio:.2e}")
        self.assertLessEqual(ratio, WEIGHT_TOL, what)

    def test_llama_on_nvme_matches_torch_adamw(self):
        data = on_gpu(batches(10))
        ref = llama_eager().to(DEV)
        init = cpu_state(ref)
        l_torch = torch_run(ref, data)
        m = llama_eager().to(DEV)
        engine, _, _, _ = st.initialize(model=m, config=ds_config(self.nvme()))
        self.assertEqual(engine.device, DEV)
        p = m.model.layers[0].mlp.up_proj.weight
        self.assertEqual((p.device, p.stride()), (DEV, (0, 0)), "between uses: the placeholder, on the GPU")
        seen = []

        def peek(mod, args):  # runs after the engine's pre-hook: the weight views the engine's buffer
            w = mod.weight
            seen.append((w.device, w.untyped_storage().data_ptr() in engine._live))
        h = m.model.layers[0].mlp.up_proj.register_forward_pre_hook(peek)
        l_strata = strata_run(engine, data)
        h.remove()
        self.assertEqual(set(seen), {(DEV, True)})
        self.assertGreater(engine.stats()["tier_bytes"]["nvme"], 0)
        self.assertEqual(list(engine._wrapped), [torch.cuda.current_stream(DEV).cuda_stream])
        self.assertFalse(engine._held)
        self.compare("cuda: llama, params and optimizer on NVMe", ref, init, engine.state_dict(), l_strata, l_torch)
        engine.destroy()

    def test_accumulation_clipping_and_a_torch_scheduler(self):
        data = on_gpu(batches(8))
        ref = llama_eager().to(DEV)
        init = cpu_state(ref)
        sched = lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: min(1.0, (s + 1) / 3))  # noqa: E731
        l_torch = torch_run(ref, data, accum=2, clip=0.5, sched=sched)
        engine, _, _, _ = st.initialize(model=llama_eager().to(DEV), config=ds_config(self.nvme(), accum=2, clip=0.5),
                                        lr_scheduler=sched)
        l_strata = strata_run(engine, data)
        self.compare("cuda: llama, accumulation 2, clipping 0.5, LambdaLR warm-up", ref, init, engine.state_dict(),
                     l_strata, l_torch)
        engine.destroy()

    def test_compute_copies_on_the_device(self):
        # No offload_param: the planner keeps the compute copies in the
        # engine's device memory (no uploads), and the step rewrites them
        # there while the caller's stream may still be reading them (the
        # release orders it).
        data = on_gpu(batches(6))
        ref = llama_eager().to(DEV)
        init = cpu_state(ref)
        l_torch = torch_run(ref, data)
        cfg = ds_config(None)
        del cfg["zero_optimization"]["offload_param"]
        engine, _, _, _ = st.initialize(model=llama_eager().to(DEV), config=cfg)
        l_strata = strata_run(engine, data)
        self.assertGreater(engine.stats()["tier_bytes"]["device"], 0)
        self.compare("cuda: llama, compute copies in device memory", ref, init, engine.state_dict(), l_strata,
                     l_torch)
        engine.destroy()

    def test_bf16_and_fp16_compute(self):
        data = on_gpu(batches(6))
        e32, _, _, _ = st.initialize(model=llama_eager().to(DEV), config=ds_config(None))
        fp32 = strata_run(e32, data)
        e32.destroy()
        for key, sect, dt in (("bf16", {"enabled": True}, torch.bfloat16),
                              ("fp16", {"enabled": True, "initial_scale_power": 10}, torch.float16)):
            m = llama_eager().to(DEV)
            engine, _, _, _ = st.initialize(model=m, config=ds_config(self.nvme(key), extra={key: sect}))
            losses = strata_run(engine, data)
            self.assertFalse(engine.last_step["skipped"])
            p = next(m.parameters())
            self.assertEqual((p.dtype, p.device), (dt, DEV))
            print(f"  cuda {key} compute copies: losses {[round(x, 4) for x in losses]} "
                  f"(fp32: {[round(x, 4) for x in fp32]})")
            for a, b in zip(losses, fp32):
                self.assertLess(abs(a - b) / b, 1e-2, key)
            engine.destroy()

    def test_tied_embeddings_three_layers_prefetch_zero(self):
        # Released buffers are poisoned (NaN): a view read after its group's
        # release (on the GPU: before the stream passed the release) shows.
        data = on_gpu(batches(6))
        ref = llama_eager(tied=True, layers=3).to(DEV)
        init = cpu_state(ref)
        l_torch = torch_run(ref, data)
        strata_cfg = {"prefetch_depth": 0, "debug_poison_released": True}
        engine, _, _, _ = st.initialize(model=llama_eager(tied=True, layers=3).to(DEV),
                                        config=ds_config(self.nvme(), extra={"strata": strata_cfg}))
        l_strata = strata_run(engine, data)
        self.compare("cuda: llama, tied embeddings, 3 layers, prefetch_depth 0, poisoned releases", ref, init,
                     engine.state_dict(), l_strata, l_torch)
        engine.destroy()

    def test_activation_checkpointing(self):
        for reentrant in (True, False):
            data = on_gpu(batches(4))
            ref = llama_eager(layers=3).to(DEV)
            ref.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
            init = cpu_state(ref)
            l_torch = torch_run(ref, data)
            m = llama_eager(layers=3).to(DEV)
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
            cfg = ds_config(self.nvme(f"ckpt{int(reentrant)}"), extra={"strata": {"debug_poison_released": True}})
            engine, _, _, _ = st.initialize(model=m, config=cfg)
            l_strata = strata_run(engine, data)
            self.compare(f"cuda: llama, activation checkpointing (use_reentrant={reentrant})", ref, init,
                         engine.state_dict(), l_strata, l_torch)
            self.assertFalse(engine._held or engine._copies, "nothing held or copied after backward")
            engine.destroy()

    def test_peft_lora_frozen_base_on_nvme(self):
        from peft import LoraConfig, get_peft_model
        data = on_gpu(batches(6))
        lcfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], lora_dropout=0.0,
                          init_lora_weights=False)
        torch.manual_seed(5)
        ref = get_peft_model(llama_eager(), lcfg).to(DEV)
        init = cpu_state(ref)
        m = copy.deepcopy(ref)
        l_torch = torch_run(ref, data)
        engine, _, _, _ = st.initialize(model=m, model_parameters=[p for p in m.parameters() if p.requires_grad],
                                        config=ds_config(self.nvme()))
        l_strata = strata_run(engine, data)
        sd = engine.state_dict()
        self.compare("cuda: PEFT LoRA (frozen base on NVMe)", ref, init, sd, l_strata, l_torch)
        for k, v in init.items():
            if "lora_" not in k:
                self.assertTrue(torch.equal(sd[k], v), f"frozen {k} changed")
        engine.destroy()

    def test_streams(self):
        # Micro-batches under another stream: the engine wraps it (once) and
        # orders its uploads and releases against it; the same losses as on
        # the default stream. Released buffers are poisoned, so a missing
        # wait shows as NaN.
        cfg = ds_config(None, extra={"strata": {"debug_poison_released": True, "prefetch_depth": 0}})
        data = on_gpu(batches(6))
        e1, _, _, _ = st.initialize(model=llama_eager().to(DEV), config=cfg)
        want = strata_run(e1, data)
        e1.destroy()
        engine, _, _, _ = st.initialize(model=llama_eager().to(DEV), config=cfg)
        default = torch.cuda.current_stream(DEV)
        side = torch.cuda.Stream(DEV)
        got = strata_run(engine, data[:2])
        side.wait_stream(default)
        with torch.cuda.stream(side):
            got += strata_run(engine, data[2:4])
            self.assertEqual(engine._active, side.cuda_stream)
        default.wait_stream(side)
        got += strata_run(engine, data[4:])
        self.assertEqual(sorted(engine._wrapped), sorted({default.cuda_stream, side.cuda_stream}))
        for i, (a, b) in enumerate(zip(got, want)):
            self.assertLessEqual(abs(a - b) / b, 1e-6, f"micro-batch {i}: {got} vs {want}")
        engine.destroy()

        # A child module computing on another stream while its parent's group
        # is held: refused by name, the step abandoned, the engine usable after.
        class Parent(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.w = torch.nn.Parameter(torch.randn(8, 8) * 0.1)
                self.child = torch.nn.Linear(8, 8)
                self.stream = None

            def forward(self, x):
                x = x @ self.w
                with torch.cuda.stream(self.stream):
                    return self.child(x)
        m = Parent().to(DEV)
        engine, _, _, _ = st.initialize(model=m, config=ds_config(None))
        x = torch.randn(4, 8, device=DEV)
        m.stream = side
        with self.assertRaisesRegex(StrataError, "current stream .* groups .* are held"):
            engine(x)
        self.assertFalse(engine._held)
        m.stream = default
        engine.backward(engine(x).square().mean())
        self.assertIsNotNone(engine.step())
        engine.destroy()

    def test_device_budget(self):
        # No strata.device_memory: half the memory free at initialize();
        # device_reserve 0. A given device_memory is the engine's as is.
        free, total = torch.cuda.mem_get_info(DEV)
        engine, _, _, _ = st.initialize(model=llama_eager().to(DEV), config=ds_config(None))
        self.assertGreater(engine.device_memory, 0)
        self.assertLessEqual(engine.device_memory, total // 2)
        engine.destroy()
        engine, _, _, _ = st.initialize(model=llama_eager().to(DEV), config=ds_config(
            None, extra={"strata": {"device_memory_fraction": 0.125}}))
        self.assertLessEqual(engine.device_memory, total // 8)
        engine.destroy()
        engine, _, _, _ = st.initialize(model=llama_eager().to(DEV), config=ds_config(
            None, extra={"strata": {"device_memory": "1GiB"}}))
        self.assertEqual(engine.device_memory, "1GiB")
        strata_run(engine, on_gpu(batches(2)))
        engine.destroy()
        with self.assertRaisesRegex(ValueError, "both strata.device_memory and strata.device_memory_fraction"):
            both = {"device_memory": GiB, "device_memory_fraction": 0.5}
            st.initialize(model=llama_eager().to(DEV), config=ds_config(None, extra={"strata": both}))
        m = llama_eager().to(DEV)
        m.lm_head.cpu()
        with self.assertRaisesRegex(ValueError, "lm_head.weight is on cpu"):
            st.initialize(model=m, config=ds_config(None))

    def _need_accelerate(self):
        # transformers.Trainer needs accelerate: a missing reference skips
        # (fails under STRATA_REQUIRE_REFERENCE=1), as in test_hf_trainer.
        if importlib.util.find_spec("accelerate") is None:
            if os.environ.get("STRATA_REQUIRE_REFERENCE") == "1":
                self.fail("accelerate (transformers.Trainer's) is not installed and STRATA_REQUIRE_REFERENCE=1")
            self.skipTest("accelerate (transformers.Trainer's) is not installed")

    def _trainer(self, **kw):
        self._need_accelerate()
        from test_hf_trainer import RecordingStrataTrainer, Tokens, strata_cfg, targs
        return RecordingStrataTrainer(model=llama_eager(), args=targs(os.path.join(self.dir, "strata"), use_cpu=False,
                                                                      **kw),
                                      train_dataset=Tokens(12), strata_config=strata_cfg(self.nvme()))

    def test_trainer_on_the_gpu(self):
        self._need_accelerate()
        from test_hf_trainer import PlainTrainer, Tokens, logged, targs
        ref = llama_eager()
        init = cpu_state(ref)
        tp = PlainTrainer(model=ref, args=targs(os.path.join(self.dir, "plain"), use_cpu=False, max_steps=3),
                          train_dataset=Tokens(12))
        tp.train()
        ts = self._trainer(max_steps=3)
        ts.train()
        self.assertEqual(ts.strata_engine.device, DEV)
        self.assertEqual(logged(ts, "learning_rate"), logged(tp, "learning_rate"))
        norm_err = max(abs(a - b) / b for a, b in zip(logged(ts, "grad_norm"), logged(tp, "grad_norm")))
        self.assertLessEqual(norm_err, LOSS_TOL)
        self.compare("cuda: StrataTrainer vs Trainer (adamw_torch), accumulation 2, decay groups, clipping", ref,
                     init, ts.strata_engine.state_dict(), ts.losses, tp.losses)
        ts.destroy()

    def test_trainer_fp16_on_the_gpu(self):
        # fp16=True: Strata's loss scaling, not Accelerate's GradScaler.
        ts = self._trainer(max_steps=2, fp16=True)
        self.assertIsNone(ts.accelerator.scaler)
        ts.train()
        self.assertEqual(len(ts.losses), 4)
        self.assertTrue(all(x == x and abs(x) < 100 for x in ts.losses), ts.losses)
        ts.destroy()


# ---------------------------------------------------------------- the GPU path's logic, simulated

class _FakeStream:
    def __init__(self, handle):
        self.cuda_stream = handle


class SimulatedCudaTest(unittest.TestCase):
    """StrataEngine's CUDA branch on the host backend: _is_cuda says yes, the
    engine is created as DEVICE_HOST, strata_stream_wrap makes a host stream,
    torch.cuda.current_stream / device / mem_get_info are stand-ins, and the
    acquire stand-in synchronizes (what the CUDA stream's wait does for the
    GPU), so the numbers must equal the host path's."""

    CALLS = ("strata_engine_create", "strata_engine_load_param", "strata_engine_acquire", "strata_engine_release",
             "strata_engine_param_dlpack", "strata_engine_reduce_grad_dlpack", "strata_engine_begin_micro_batch",
             "strata_engine_loss_scale", "strata_engine_step", "strata_engine_set_group_lr",
             "strata_engine_read_param", "strata_engine_discard_step", "strata_engine_destroy",
             "strata_stream_destroy")

    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="strata-torch-simcuda-", dir=os.environ.get("STRATA_TEST_DIR"))
        self.addCleanup(shutil.rmtree, self.dir, ignore_errors=True)

    def simulate(self):
        """Patches for the rest of the test; returns the record they keep."""
        rec = {"wrapped": [], "acquire_streams": [], "release_streams": [], "configs": [], "outside": [],
               "syncs": 0, "depth": 0, "current": 0}
        real = {name: getattr(_lib, name)
                for name in self.CALLS + ("strata_stream_create", "strata_stream_synchronize")}

        def checked(name):
            def call(*args):
                if rec["depth"] == 0:
                    rec["outside"].append(name)
                if name == "strata_engine_create":
                    rec["configs"].append(json.loads(args[0]._obj.config_json))
                    self.assertEqual(args[0]._obj.device_kind, _lib.DEVICE_HOST)  # DEVICE_CUDA, patched below
                rc = real[name](*args)
                if name == "strata_engine_acquire" and rc == 0:
                    rec["acquire_streams"].append(args[2].value)
                    rc = real["strata_stream_synchronize"](args[2])
                if name == "strata_engine_release":
                    rec["release_streams"].append(args[2].value)
                return rc
            return call

        def wrap(e, native, out):
            rec["wrapped"].append(native.value or 0)
            return real["strata_stream_create"](e, b"simulated wrapped stream", out)

        def sync(s):
            rec["syncs"] += 1
            return real["strata_stream_synchronize"](s)

        @contextlib.contextmanager
        def device(d):
            rec["depth"] += 1
            try:
                yield
            finally:
                rec["depth"] -= 1

        patches = [mock.patch.object(st_engine, "_is_cuda", lambda d: True),
                   mock.patch.object(_lib, "DEVICE_CUDA", _lib.DEVICE_HOST),
                   mock.patch.object(_lib, "strata_stream_wrap", wrap),
                   mock.patch.object(_lib, "strata_stream_synchronize", sync),
                   mock.patch.object(torch.cuda, "current_stream", lambda device=None: _FakeStream(rec["current"])),
                   mock.patch.object(torch.cuda, "device", device),
                   mock.patch.object(torch.cuda, "mem_get_info", lambda device=None: (8 * GiB, 16 * GiB))]
        patches += [mock.patch.object(_lib, name, checked(name)) for name in self.CALLS]
        for p in patches:
            p.start()
            self.addCleanup(p.stop)
        return rec

    def test_trains_like_the_host_path(self):
        data = batches(6)
        cfg = ds_config(os.path.join(self.dir, "a"), accum=2, extra={"strata": {"debug_poison_released": True}})
        m = llama(layers=3)
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        host, _, _, _ = st.initialize(model=m, config=cfg)
        want = strata_run(host, data)
        want_sd = host.state_dict()
        host.destroy()
        rec = self.simulate()
        cfg = ds_config(os.path.join(self.dir, "b"), accum=2, extra={"strata": {"debug_poison_released": True}})
        m = llama(layers=3)
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        engine, _, _, _ = st.initialize(model=m, config=cfg)
        self.assertTrue(engine._cuda)
        got = strata_run(engine, data)
        sd = engine.state_dict()
        engine.destroy()
        self.assertEqual(got, want)
        for k, v in sd.items():
            self.assertTrue(torch.equal(v, want_sd[k]), k)
        self.assertEqual(rec["wrapped"], [0], "torch's current stream is wrapped once")
        self.assertEqual(rec["syncs"], 0, "no host synchronize after acquire on CUDA")
        self.assertEqual(rec["outside"], [], "every engine call inside the engine's device context")
        self.assertEqual(len(set(rec["acquire_streams"] + rec["release_streams"])), 1)
        sect = rec["configs"][0]["strata"]
        self.assertEqual((sect["device_memory"], sect["device_reserve"]), (4 * GiB, 0))
        self.assertNotIn("device_memory_fraction", sect)
        self.assertEqual(engine.device_memory, 4 * GiB)

    def test_streams_switch_between_uses_and_a_change_while_held_is_refused(self):
        rec = self.simulate()
        data = batches(4)
        engine, _, _, _ = st.initialize(model=llama(), config=ds_config(None))
        strata_run(engine, data[:1])
        rec["current"] = 0x5000  # torch.cuda.stream(side) around a micro-batch
        strata_run(engine, data[1:2])
        self.assertEqual(engine._active, 0x5000)
        rec["current"] = 0
        strata_run(engine, data[2:3])
        self.assertEqual(rec["wrapped"], [0, 0x5000], "one wrapper per stream, cached")
        n = len(rec["acquire_streams"]) // 3  # as many acquires in each micro-batch
        first, second, third = (set(rec["acquire_streams"][i * n:(i + 1) * n]) for i in range(3))
        self.assertTrue(len(first) == len(second) == 1 and first == third and first != second,
                        "each micro-batch acquires on its own current stream's wrapper")

        class Parent(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.w = torch.nn.Parameter(torch.randn(8, 8) * 0.1)
                self.child = torch.nn.Linear(8, 8)
                self.switch = True

            def forward(self, x):
                x = x @ self.w
                if self.switch:
                    rec["current"] = 0x7000  # another stream while the parent's group is held
                try:
                    return self.child(x)
                finally:
                    rec["current"] = 0
        m = Parent()
        e2, _, _, _ = st.initialize(model=m, config=ds_config(None))
        with self.assertRaisesRegex(StrataError, r"current stream on cpu is 0x7000 here, but groups \['<root>'\] "
                                                 r"are held on stream 0x0"):
            e2(torch.randn(4, 8))
        self.assertFalse(e2._held)
        m.switch = False
        e2.backward(e2(torch.randn(4, 8)).square().mean())
        self.assertIsNotNone(e2.step())
        e2.destroy()
        engine.destroy()

    def test_device_budget(self):
        rec = self.simulate()
        for strata_sect, memory, reserve in (({"device_memory_fraction": 0.25}, 2 * GiB, 0),
                                             ({"device_memory": "1GiB"}, "1GiB", 0),
                                             ({"device_memory": 0, "device_reserve": "256MiB"}, 4 * GiB, "256MiB")):
            engine, _, _, _ = st.initialize(model=llama(), config=ds_config(None, extra={"strata": strata_sect}))
            self.assertEqual(engine.device_memory, memory)
            sect = rec["configs"][-1]["strata"]
            self.assertEqual((sect["device_memory"], sect["device_reserve"]), (memory, reserve))
            engine.destroy()
        for bad, msg in (({"device_memory_fraction": 1.5}, "device_memory_fraction is 1.5"),
                         ({"device_memory_fraction": "half"}, "device_memory_fraction is 'half'"),
                         ({"device_memory": GiB, "device_memory_fraction": 0.5}, "keep one")):
            with self.assertRaisesRegex(ValueError, msg):
                st.initialize(model=llama(), config=ds_config(None, extra={"strata": bad}))


class DeviceRefusalTest(unittest.TestCase):
    """Runs everywhere: which devices initialize() takes."""

    def test_refusals(self):
        m = llama()
        m.lm_head.to("meta")
        with self.assertRaisesRegex(ValueError, r"lm_head.weight is on meta and model.embed_tokens.weight on cpu"):
            st.initialize(model=m, config=ds_config(None))
        with self.assertRaisesRegex(NotImplementedError, r"model.embed_tokens.weight is on meta"):
            st.initialize(model=llama().to("meta"), config=ds_config(None))
        with self.assertRaisesRegex(ValueError, "device_memory_fraction is for a model on a GPU"):
            st.initialize(model=llama(), config=ds_config(None, extra={"strata": {"device_memory_fraction": 0.5}}))

    def test_require_gpu(self):
        # What GpuTest does where the GPU path cannot run: a skip, or a
        # failure under STRATA_REQUIRE_GPU=1.
        why = gpu_unavailable()
        if not why:
            self.skipTest("the GPU path can run here")
        res = unittest.TestResult()
        with mock.patch(f"{__name__}.REQUIRE_GPU", True):
            GpuTest("test_streams").run(res)
        self.assertEqual((len(res.failures), len(res.skipped)), (1, 0))
        self.assertIn("STRATA_REQUIRE_GPU=1", res.failures[0][1])
        res = unittest.TestResult()
        with mock.patch(f"{__name__}.REQUIRE_GPU", False):
            GpuTest("test_streams").run(res)
        self.assertEqual((len(res.failures), len(res.skipped)), (0, 1))


if __name__ == "__main__":
    unittest.main()
