"""strata.torch's engine against DeepSpeed's own engine API and classes
(DeepSpeed 0.19.8), where a DeepSpeed user's code meets them:

- the fp16 dynamic loss scale step by step against deepspeed's
  DynamicLossScaler fed the same overflows (scale after each step, skipped
  steps);
- the batch sizes (train_batch_size, train_micro_batch_size_per_gpu,
  gradient_accumulation_steps) derived and checked as DeepSpeedConfig does,
  and the derived accumulation taking effect;
- param group options the engine does not implement per group (eps,
  amsgrad, maximize) or takes once (weight_decay, eps edited between steps)
  refused by name, never ignored;
- save_checkpoint / load_checkpoint with DeepSpeed's signature, layout
  (save_dir/tag, save_dir/latest) and return value; a resume after a
  scheduler that cycles the betas (OneCycle) is bit-identical;
- the engine methods DeepSpeed code calls (train, eval, zero_grad,
  parameters, global_steps, was_step_applied, get_global_grad_norm,
  backward(retain_graph=)), and loss.backward() in place of engine.backward()
  named instead of failing later.

DeepSpeed is the reference: without it the tests that need it skip, and fail
under STRATA_REQUIRE_REFERENCE=1 (CI installs deepspeed==0.19.8).
"""
import copy
import logging
import os
import shutil
import tempfile
import unittest
import warnings

import torch

import strata
import strata.torch as st
from strata.torch.engine import _load_config


def deepspeed_module(test, name):
    """A deepspeed module, or skip (fail under STRATA_REQUIRE_REFERENCE=1)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        import importlib
        mod = importlib.import_module(name)
    except Exception as e:  # ImportError, or a deepspeed that cannot start here
        if os.environ.get("STRATA_REQUIRE_REFERENCE") == "1":
            test.fail(f"{name} does not import ({e!r}) and STRATA_REQUIRE_REFERENCE=1: pip install deepspeed==0.19.8")
        test.skipTest(f"deepspeed is the reference and does not import: {e!r}")
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    return mod


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.l1 = torch.nn.Linear(8, 16)
        self.norm = torch.nn.LayerNorm(16)
        self.l2 = torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.l2(torch.tanh(self.norm(self.l1(x))))


def batches(n):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(5, 8, generator=g), torch.randn(5, 4, generator=g)) for _ in range(n)]


def config(extra=None, **params):
    p = {"lr": 1e-2, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}
    p.update(params)
    c = {"optimizer": {"type": "AdamW", "params": p},
         "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"},
                               "offload_optimizer": {"device": "cpu"}}}
    c.update(extra or {})
    return c


def make(cfg, model_parameters=None, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m = MLP()
        params = model_parameters(m) if model_parameters else None
        return st.initialize(model=m, model_parameters=params, config=cfg, **kw)[0]


def train(engine, data):
    out = []
    for x, y in data:
        loss = ((engine(x) - y) ** 2).mean()
        engine.backward(loss)
        out.append(engine.step())
    return out


class DeepSpeedApiTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="strata-dsapi-")
        self.engines = []

    def tearDown(self):
        for e in self.engines:
            e.destroy()
        shutil.rmtree(self.dir, ignore_errors=True)

    def engine(self, *args, **kw):
        e = make(*args, **kw)
        self.engines.append(e)
        return e

    def test_the_fp16_loss_scale_is_deepspeeds_step_for_step(self):
        ls = deepspeed_module(self, "deepspeed.runtime.fp16.loss_scaler")
        ls.dist.get_rank = lambda *a, **k: 1  # the class logs on rank 0 only; no process group here
        overflows = [1, 1, 0, 0, 0, 1, 0, 0, 0, 0, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0]
        cases = [([0] * 9, {"loss_scale_window": 3, "hysteresis": 2, "initial_scale_power": 8}),
                 (overflows, {"loss_scale_window": 2, "hysteresis": 2, "initial_scale_power": 8}),
                 (overflows, {"loss_scale_window": 3, "hysteresis": 3, "consecutive_hysteresis": True,
                              "initial_scale_power": 8}),
                 (overflows, {"loss_scale_window": 2, "hysteresis": 1, "initial_scale_power": 4,
                              "min_loss_scale": 4})]
        for pattern, fp16 in cases:
            with self.subTest(fp16=fp16):
                e = self.engine(config({"fp16": dict(fp16, enabled=True)}))
                ds = ls.DynamicLossScaler(init_scale=2 ** fp16["initial_scale_power"],
                                          scale_window=fp16["loss_scale_window"],
                                          min_scale=fp16.get("min_loss_scale", 1), delayed_shift=fp16["hysteresis"],
                                          consecutive_hysteresis=fp16.get("consecutive_hysteresis", False),
                                          raise_error_at_min_scale=False)
                for i, ((x, y), overflow) in enumerate(zip(batches(len(pattern)), pattern)):
                    loss = ((e(x.half()).float() - y) ** 2).mean() * (1e30 if overflow else 1.0)
                    e.backward(loss)
                    r = e.step()
                    ds.update_scale(bool(overflow))
                    self.assertEqual((r["loss_scale"], r["skipped"]), (ds.cur_scale, bool(overflow)), f"step {i}")
                    self.assertEqual(e.was_step_applied(), not overflow)
                self.assertEqual(e.skipped_steps, sum(pattern))
                self.assertEqual(e.global_steps, len(pattern))

    def test_clipping_and_precision_defaults_are_deepspeeds(self):
        # What DeepSpeedConfig makes of a config is what the engine does: no
        # gradient_clipping (or "auto") clips at DeepSpeed's 1.0; "auto" in a
        # precision section is off; "bfloat16" is bf16's older name.
        cfg_mod = deepspeed_module(self, "deepspeed.runtime.config")
        for extra in ({}, {"gradient_clipping": "auto"}, {"gradient_clipping": 0.5}, {"fp16": {"enabled": "auto"}},
                      {"bf16": {"enabled": "auto"}}, {"bfloat16": {"enabled": True}}, {"bf16": {"enabled": True}}):
            with self.subTest(extra=extra):
                ds = cfg_mod.DeepSpeedConfig(dict(extra, train_micro_batch_size_per_gpu=5))
                want_dtype = (torch.bfloat16 if ds.bfloat16_config.enabled else
                              torch.float16 if ds.float16_config.enabled else torch.float32)
                e = self.engine(config(extra))
                self.assertEqual(e.compute_dtype, want_dtype)
                if want_dtype != torch.float32:
                    continue
                want_clip = 1.0 if ds.gradient_clipping == "auto" else ds.gradient_clipping
                # torch's AdamW with clip_grad_norm_ at that value (the norms here are 1.5-2.2).
                ref = MLP()
                opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, eps=1e-8, weight_decay=0.0)
                data = batches(3)
                for x, y in data:
                    opt.zero_grad()
                    ((ref(x) - y) ** 2).mean().mul(40).backward()
                    torch.nn.utils.clip_grad_norm_(ref.parameters(), want_clip)
                    opt.step()
                for x, y in data:
                    e.backward(((e(x) - y) ** 2).mean().mul(40))
                    e.step()
                    self.assertGreater(e.get_global_grad_norm(), want_clip)
                got = e.state_dict()
                for name, b in ref.named_parameters():
                    torch.testing.assert_close(got[name].float(), b.detach(), rtol=0, atol=2e-6, msg=name)
        # A scheduler made on another optimizer would drive nothing: refused.
        other = torch.optim.AdamW(MLP().parameters(), lr=1e-2)
        with self.assertRaisesRegex(ValueError, "lr_scheduler= was built on another optimizer"):
            make(config(), lr_scheduler=torch.optim.lr_scheduler.StepLR(other, 1, gamma=0.1))
        with self.assertRaisesRegex(ValueError, "fp16.enabled is 'yes'"):
            make(config({"fp16": {"enabled": "yes"}}))

    def test_batch_sizes_are_derived_and_checked_as_deepspeed_does(self):
        dsc = deepspeed_module(self, "deepspeed.runtime.config")
        keys = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
        for given in ({"train_batch_size": 20, "train_micro_batch_size_per_gpu": 5},
                      {"train_batch_size": 12, "gradient_accumulation_steps": 3},
                      {"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 2},
                      {"train_batch_size": 8}, {"train_micro_batch_size_per_gpu": 3},
                      {"train_batch_size": 12, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 3},
                      {"train_batch_size": 12.0, "train_micro_batch_size_per_gpu": 4.0}):
            with self.subTest(given=given):
                ref = dsc.DeepSpeedConfig(dict(given))
                e = self.engine(config(given))
                self.assertEqual(tuple(getattr(e, k) for k in keys), tuple(getattr(ref, k) for k in keys))
        for bad in ({"train_batch_size": 7, "train_micro_batch_size_per_gpu": 5, "gradient_accumulation_steps": 2},
                    {"train_batch_size": 20, "train_micro_batch_size_per_gpu": 6}):
            with self.subTest(bad=bad):
                with self.assertRaises(AssertionError):
                    dsc.DeepSpeedConfig(dict(bad))
                with self.assertRaisesRegex(ValueError, "batch sizes do not agree"):
                    make(config(bad))
        with self.assertRaisesRegex(ValueError, "train_batch_size is \"auto\""):
            make(config({"train_batch_size": "auto"}))
        # The derived accumulation acts: 20 / 5 -> one optimizer step per 4 micro-batches.
        e = self.engine(config({"train_batch_size": 20, "train_micro_batch_size_per_gpu": 5}))
        steps = [r is not None for r in train(e, batches(8))]
        self.assertEqual(steps, [False, False, False, True] * 2)
        self.assertEqual((e.global_steps, e.global_samples), (2, 40))
        # DeepSpeed's engine has them as methods; plain numbers work too.
        self.assertEqual((e.train_batch_size(), e.train_micro_batch_size_per_gpu(), e.gradient_accumulation_steps()),
                         (20, 5, 4))
        self.assertEqual(e.gradient_accumulation_steps * 2, 8)

    def test_config_files_are_read_as_deepspeed_reads_them(self):
        # A path: comments allowed (DeepSpeed reads it with hjson), duplicate
        # keys refused as DeepSpeed refuses them (plain json keeps the last
        # one without a word), a syntax error named with the file.
        dsc = deepspeed_module(self, "deepspeed.runtime.config")
        path = os.path.join(self.dir, "ds.json")

        def write(text):
            with open(path, "w") as f:
                f.write(text)

        write('{\n  // clip hard\n  "gradient_clipping": 0.25, /* "gradient_clipping": 0, */\n'
              '  "train_micro_batch_size_per_gpu": 1,\n  "note": "a // that is text"\n}\n')
        self.assertEqual(dsc.DeepSpeedConfig(path).gradient_clipping, 0.25)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "note" is named as not used
            self.assertEqual(_load_config(path)["gradient_clipping"], 0.25)
        write('{"gradient_clipping": 0.5, "train_micro_batch_size_per_gpu": 1, "gradient_clipping": 0}')
        with self.assertRaisesRegex(ValueError, "Duplicate keys"):
            dsc.DeepSpeedConfig(path)
        with self.assertRaisesRegex(ValueError, r"ds\.json: duplicate keys \['gradient_clipping'\]"):
            make(path)
        for c in ({"optimizer": "auto"}, {"optimizer": {"type": "AdamW", "params": "auto"}}):
            with self.assertRaisesRegex(ValueError, "expected an object"):  # a section is never "auto"
                make(c)
        write('{"gradient_clipping": 0.5,\n "zero_optimization": {"stage": 3,}}')
        with self.assertRaisesRegex(ValueError, r"config file .*ds\.json: .*line 2"):
            make(path)

    def test_torch_loop_habits_are_exact_or_refused(self):
        # What plain torch training code does around the engine: each either
        # gives torch's result or is refused by name (each was silently
        # different: no update, the skipped batch kept, an edit dropped).
        data = batches(4)

        def torch_reference(skip):
            m = MLP()
            opt = torch.optim.AdamW(m.parameters(), lr=1e-2, eps=1e-8, weight_decay=0.0)
            for i, (x, y) in enumerate(data):
                ((m(x) - y) ** 2).mean().backward()
                if i == skip:
                    opt.zero_grad()  # a batch skipped after its backward
                    continue
                torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
                opt.step()
                opt.zero_grad()
            return {n: p.detach().clone() for n, p in m.named_parameters()}, m

        # The returned optimizer's zero_grad() drops the micro-batches taken
        # since the last step (DeepSpeed's ZeRO optimizer: the next backward
        # overwrites them), as torch's does; engine.zero_grad() and
        # model.zero_grad() hold nothing to drop, as under DeepSpeed.
        ref, m0 = torch_reference(skip=1)
        w0 = {n: p.detach().clone() for n, p in MLP().named_parameters()}
        e = self.engine(config())
        for i, (x, y) in enumerate(data):
            e.backward(((e(x) - y) ** 2).mean())
            if i == 1:
                e.optimizer.zero_grad()
                continue
            e.step()
        got = e.state_dict()
        err = max(((got[n] - ref[n]).abs().max() / (ref[n] - w0[n]).abs().max()).item() for n in ref)
        self.assertLess(err, 1e-4)
        # With accumulation, the window counts on: a torch loop's zero_grad()
        # before every micro-batch still steps at every boundary (the step
        # takes the last micro-batch, as DeepSpeed's), never stalls.
        e = self.engine(config({"gradient_accumulation_steps": 2}))
        for x, y in batches(8):
            e.optimizer.zero_grad()
            e.module.zero_grad()
            e.zero_grad()
            e.backward(((e(x) - y) ** 2).mean())
            e.step()
        self.assertEqual(e.global_steps, 4)
        # optimizer.step() where engine.step() belongs: refused, not a step that updates nothing.
        e = self.engine(config())
        x, y = data[0]
        e.backward(((e(x) - y) ** 2).mean())
        with self.assertRaisesRegex(strata.StrataError, r"optimizer.step\(\) .* call engine.step\(\)"):
            e.optimizer.step()
        e.step()
        e.optimizer.step()  # after the engine's step (the Hugging Face Trainer calls both): nothing to do
        # A second backward through a retained graph: refused, not every gradient reduced twice.
        loss = ((e(x) - y) ** 2).mean()
        e.backward(loss, retain_graph=True)
        with self.assertRaisesRegex(strata.StrataError, "no forward of the model since the last backward"):
            e.backward(loss)

    def test_weights_changed_outside_the_engine_are_refused(self):
        # An in-place change during forward (nn.Embedding's max_norm) and a
        # .data assignment after initialize() would reach a copy only.
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Embedding(10, 4, max_norm=0.5), torch.nn.Linear(4, 2))
        e = st.initialize(model=m, config=config())[0]
        self.engines.append(e)
        with self.assertRaisesRegex(strata.StrataError, "0.weight was changed in place during Embedding's forward"):
            e(torch.tensor([[1, 2, 3]]))
        e2 = self.engine(config())
        e2.module.l1.weight.data = torch.zeros(16, 8)
        with self.assertRaisesRegex(strata.StrataError, r"l1.weight's .data was replaced after initialize\(\)"):
            e2(batches(1)[0][0])

    def test_checkpoints_hold_the_module_buffers(self):
        # BatchNorm's running statistics go with the weights, as in DeepSpeed's checkpoint.
        def model():
            torch.manual_seed(0)
            return torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.BatchNorm1d(6), torch.nn.Linear(6, 4))

        e = st.initialize(model=model(), config=config())[0]
        self.engines.append(e)
        for x, y in batches(3):
            e.backward(((e(x) - y) ** 2).mean())
            e.step()
        bn = e.module[1]
        saved = {k: v.clone() for k, v in bn.named_buffers()}
        e.save_checkpoint(self.dir, tag="t")
        f = st.initialize(model=model(), config=config())[0]
        self.engines.append(f)
        self.assertFalse(torch.equal(f.module[1].running_mean, saved["running_mean"]))
        f.load_checkpoint(self.dir, tag="t")
        for k, v in f.module[1].named_buffers():
            self.assertTrue(torch.equal(v, saved[k]), k)
        f.eval()
        e.eval()
        with torch.no_grad():
            x = batches(1)[0][0]
            self.assertTrue(torch.equal(f(x), e(x)))

    def test_param_group_options_the_engine_does_not_take_are_refused(self):
        def split(**opts):
            return lambda m: [{"params": [m.l1.weight, m.l2.weight], **opts},
                              {"params": [m.l1.bias, m.l2.bias, m.norm.weight, m.norm.bias]}]
        for opts, what in (({"eps": 0.1}, "eps 0.1"), ({"amsgrad": True}, "amsgrad=True"),
                           ({"maximize": True}, "maximize=True")):
            with self.subTest(opts=opts):
                with self.assertRaisesRegex(ValueError, f"param group 0 (has|sets) {what}"):
                    make(config(), model_parameters=split(**opts))
        # The config's own values are fine in a group.
        self.engine(config(), model_parameters=split(eps=1e-8, amsgrad=False, maximize=False))
        for key, value in (("weight_decay", 0.5), ("eps", 1e-3), ("amsgrad", True)):
            with self.subTest(edited=key):
                e = self.engine(config(weight_decay=0.1))
                train(e, batches(1))
                e.optimizer.param_groups[0][key] = value
                before = e.state_dict()
                x, y = batches(2)[1]
                e.backward(((e(x) - y) ** 2).mean())
                with self.assertRaisesRegex(ValueError, f"param group 0's {key} changed"):
                    e.step()
                for k, v in e.state_dict().items():
                    self.assertTrue(torch.equal(v, before[k]), k)
        # The parameter set is fixed at initialize(): a parameter removed from
        # its group (torch would stop updating it), a group added, a
        # parameter frozen then and unfrozen now (torch would train it) are
        # refused by name at the step, which changes nothing.
        def removed(e):
            e.optimizer.param_groups[0]["params"] = [p for p in e.optimizer.param_groups[0]["params"]
                                                     if p is not e.module.l2.weight]

        def added(e):
            e.optimizer.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))]})

        def unfrozen(e):
            e.module.l1.weight.requires_grad_(True)

        frozen_l1 = lambda m: [p for n, p in m.named_parameters() if n != "l1.weight"]  # noqa: E731
        for change, what, params in ((removed, "l2.weight was removed from param group 0", None),
                                     (added, "the optimizer has 2 param groups, 1 at initialize", None),
                                     (unfrozen, "parameter l1.weight was frozen", frozen_l1)):
            with self.subTest(change=what):
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    m = MLP()
                    if params:
                        m.l1.weight.requires_grad_(False)
                    e = st.initialize(model=m, model_parameters=params(m) if params else None, config=config())[0]
                self.engines.append(e)
                train(e, batches(1))
                change(e)
                before = e.state_dict()
                x, y = batches(2)[1]
                e.backward(((e(x) - y) ** 2).mean())
                with self.assertRaisesRegex(ValueError, what):
                    e.step()
                for k, v in e.state_dict().items():
                    self.assertTrue(torch.equal(v, before[k]), k)

    def test_checkpoints_have_deepspeeds_signature_layout_and_result(self):
        def onecycle(opt):
            return st.lr_schedules.from_config(opt, {"type": "OneCycle", "params": {
                "cycle_min_lr": 1e-3, "cycle_max_lr": 1e-2, "cycle_first_step_size": 3}}, where="test")
        data = batches(10)
        straight = self.engine(config(), lr_scheduler=onecycle)
        want = train(straight, data)
        first = self.engine(config(), lr_scheduler=onecycle)
        got = train(first, data[:4])
        ck = os.path.join(self.dir, "ck")
        self.assertTrue(first.save_checkpoint(ck, client_state={"epoch": 1}))  # tag: global_step4
        first.save_checkpoint(ck, "mine", {"epoch": 2}, save_latest=False)
        with open(os.path.join(ck, "latest")) as f:
            self.assertEqual(f.read(), "global_step4")
        with self.assertRaisesRegex(TypeError, "third argument"):
            first.save_checkpoint(ck, {"epoch": 3})
        first.save_checkpoint(ck, 7, save_latest=False)  # a tag is str(tag), as in DeepSpeed
        self.assertTrue(os.path.isfile(os.path.join(ck, "7", "index.json")))
        resumed = self.engine(config(), lr_scheduler=onecycle)
        # OneCycle's cycled betas differ from the config's at step 4: they come back with the checkpoint.
        self.assertEqual(resumed.load_checkpoint(ck), (os.path.join(ck, "global_step4"), {"epoch": 1}))
        self.assertEqual(resumed.global_steps, 4)
        got += train(resumed, data[4:])
        self.assertEqual(got, want)
        for k, v in resumed.state_dict().items():
            self.assertTrue(torch.equal(v, straight.state_dict()[k]), k)
        self.assertEqual(resumed.load_checkpoint(ck, tag="mine")[1], {"epoch": 2})
        self.assertEqual(resumed.load_checkpoint(ck, tag=7), (os.path.join(ck, "7"), {}))  # none saved: {}
        with self.assertWarnsRegex(UserWarning, "nothing loaded"):
            self.assertEqual(resumed.load_checkpoint(self.dir), (None, None))
        with self.assertRaisesRegex(NotImplementedError, "load_optimizer_states=False"):
            resumed.load_checkpoint(ck, load_optimizer_states=False)

    def test_torch_schedulers_resume_exactly(self):
        # Scheduler states that plain JSON changes: MultiStepLR's milestones
        # (a Counter of ints, whose keys came back as strings: the lr never
        # decayed after a resume, found by an audit) and ReduceLROnPlateau's
        # best = inf (JSON has no inf: its save was refused).
        data = batches(10)
        for make_sched in (lambda o: torch.optim.lr_scheduler.MultiStepLR(o, milestones=[5, 7], gamma=0.1),
                           lambda o: torch.optim.lr_scheduler.ReduceLROnPlateau(o, patience=0)):
            def run(engine, part):
                out = []
                for x, y in part:
                    loss = ((engine(x) - y) ** 2).mean()
                    engine.backward(loss)
                    plateau = isinstance(engine.lr_scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)
                    # DeepSpeed's lr_kwargs; a metric never better: the lr drops every step
                    out.append(engine.step(lr_kwargs={"metrics": 1.0} if plateau else None))
                return out
            straight = self.engine(config(), lr_scheduler=make_sched)
            want = run(straight, data)
            first = self.engine(config(), lr_scheduler=make_sched)
            got = run(first, data[:4])
            ck = os.path.join(self.dir, type(first.lr_scheduler).__name__)
            first.save_checkpoint(ck)
            resumed = self.engine(config(), lr_scheduler=make_sched)
            resumed.load_checkpoint(ck)
            self.assertEqual(resumed.lr_scheduler.state_dict(), first.lr_scheduler.state_dict())
            got += run(resumed, data[4:])
            self.assertEqual(got, want, type(first.lr_scheduler).__name__)
        # best = -inf before any step (JSON has no infinities).
        plateau = self.engine(config(), lr_scheduler=lambda o: torch.optim.lr_scheduler.ReduceLROnPlateau(o, "max"))
        plateau.save_checkpoint(os.path.join(self.dir, "plateau"))
        other = self.engine(config(), lr_scheduler=lambda o: torch.optim.lr_scheduler.ReduceLROnPlateau(o, "min"))
        other.load_checkpoint(os.path.join(self.dir, "plateau"))
        self.assertEqual(other.lr_scheduler.state_dict(), plateau.lr_scheduler.state_dict())
        self.assertEqual(other.lr_scheduler.best, -float("inf"))
        # What a checkpoint cannot hold is refused by name before anything is written.
        class Odd(torch.optim.lr_scheduler.LambdaLR):
            def state_dict(self):
                return {"fn": object()}
        e = self.engine(config(), lr_scheduler=lambda o: Odd(o, lambda s: 1.0))
        with self.assertRaisesRegex(TypeError, "the lr scheduler's state_dict\\(\\) holds a object"):
            e.save_checkpoint(os.path.join(self.dir, "odd"))
        self.assertFalse(os.path.exists(os.path.join(self.dir, "odd")))

    def test_checkpoint_misuse_is_named(self):
        e = self.engine(config())
        train(e, batches(2))
        # The optimizer's state lives in the engine: torch's state_dict would
        # be empty, and a loaded one would never reach it (both were silent).
        with self.assertWarnsRegex(UserWarning, "no AdamW moments: they live in the engine"):
            sd = e.optimizer.state_dict()
        self.assertEqual(sd["state"], {})
        e.optimizer.load_state_dict(sd)  # the param groups only, as accelerate round-trips it
        moments = {"state": {0: {"step": torch.tensor(1.0), "exp_avg": torch.zeros(16, 8)}},
                   "param_groups": sd["param_groups"]}
        with self.assertRaisesRegex(NotImplementedError, "engine.load_checkpoint"):
            e.optimizer.load_state_dict(moments)
        # An evaluation forward with autograd on, then a save (was refused
        # with "no micro-batch begun"; DeepSpeed saves).
        e.eval()
        x, y = batches(1)[0]
        e(x)
        ck = os.path.join(self.dir, "ck")
        self.assertTrue(e.save_checkpoint(ck, tag="t"))
        # A save of "t" killed mid-way left its staging directory: the next save of "t" removes it.
        stale = os.path.join(ck, "t.tmp-999999999-deadbeef")  # no such pid (above pid_max)
        os.makedirs(stale)
        open(os.path.join(stale, "x.bin"), "w").close()
        live = os.path.join(ck, f"t.tmp-{os.getppid()}-cafe")  # a live process's save: not ours to remove
        os.makedirs(live)
        # `latest` cannot be written (a directory in its place): named, the checkpoint kept, no temp file left.
        latest = os.path.join(ck, "latest")
        os.unlink(latest)
        os.makedirs(os.path.join(latest, "sub"))
        with self.assertRaisesRegex(strata.StrataError, r"ck/t is saved, but writing .*latest failed"):
            e.save_checkpoint(ck, tag="t")
        self.assertFalse(os.path.exists(stale))
        self.assertTrue(os.path.isdir(live))
        os.rmdir(live)
        self.assertEqual(sorted(os.listdir(ck)), ["latest", "t"])
        shutil.rmtree(latest)
        e.train()
        train(e, batches(1))
        # Files of the user's in a tag directory are not deleted by saving there again.
        with open(os.path.join(ck, "t", "metrics.json"), "w") as f:
            f.write("{}")
        with self.assertRaisesRegex(strata.StrataError, r"also holds files Strata did not write \(metrics.json\)"):
            e.save_checkpoint(ck, tag="t")
        self.assertTrue(os.path.isfile(os.path.join(ck, "t", "metrics.json")))
        # An empty or hostile `latest` is named.
        for text in ("", "../../etc"):
            with open(os.path.join(ck, "latest"), "w") as f:
                f.write(text)
            with self.assertRaisesRegex(strata.StrataError, "latest names .* not a tag"):
                e.load_checkpoint(ck)
        # step() with no backward since the last one: nothing moves, and it says so once.
        steps = e.global_steps
        with self.assertWarnsRegex(UserWarning, "no engine.backward\\(\\) since the last step"):
            self.assertIsNone(e.step())
        self.assertEqual(e.global_steps, steps)
        # DeepSpeed's engine attributes; deepcopy and use after destroy() named.
        self.assertTrue(e.training)
        self.assertEqual((e.global_rank, e.local_rank), (0, 0))
        with self.assertRaisesRegex(TypeError, "cannot be copied"):
            copy.deepcopy(e.module)
        e.destroy()
        with self.assertRaisesRegex(strata.StrataError, "the engine was destroyed"):
            e.synchronize()
        self.engines.remove(e)

    def test_deepspeeds_engine_methods(self):
        e = self.engine(config())
        self.assertIsNone(e.get_global_grad_norm())
        self.assertIs(e.eval(), e)
        self.assertFalse(e.module.training)
        e.train()
        self.assertTrue(e.module.training)
        self.assertEqual([n for n, _ in e.named_parameters()], [n for n, _ in e.module.named_parameters()])
        self.assertEqual(len(list(e.parameters())), 6)
        x, y = batches(1)[0]
        loss = ((e(x) - y) ** 2).mean()
        self.assertIs(e.backward(loss, retain_graph=True), loss)  # accumulation 1: the loss itself
        e.zero_grad()
        r = e.step()
        self.assertTrue(e.was_step_applied())
        self.assertEqual(e.get_global_grad_norm(), r["grad_norm"])
        # loss.backward() instead of engine.backward(loss): named at step(), the micro-batch discarded.
        before = e.state_dict()
        loss = ((e(x) - y) ** 2).mean()
        loss.backward()
        with self.assertRaisesRegex(strata.StrataError, "engine.backward"):
            e.step()
        for k, v in e.state_dict().items():
            self.assertTrue(torch.equal(v, before[k]), k)
        train(e, batches(2))  # and the engine goes on
        self.assertEqual(e.global_steps, 3)
        # Also on a later micro-batch of an accumulation window, whose gradients would reach the engine
        # neither divided by the accumulation nor loss-scaled.
        e = self.engine(config({"gradient_accumulation_steps": 2}))
        before = e.state_dict()
        (x0, y0), (x1, y1) = batches(2)
        loss = ((e(x0) - y0) ** 2).mean()
        self.assertEqual(e.backward(loss).item(), (loss / 2).item())  # DeepSpeed's: divided by the accumulation
        ((e(x1) - y1) ** 2).mean().backward()
        with self.assertRaisesRegex(strata.StrataError, "engine.backward"):
            e.step()
        for k, v in e.state_dict().items():
            self.assertTrue(torch.equal(v, before[k]), k)
        train(e, batches(2))
        self.assertEqual(e.global_steps, 1)
        # is_gradient_accumulation_boundary() as DeepSpeed's engine answers it:
        # (micro_steps + 1) % gas == 0, micro_steps counting step() calls
        # (True before the first micro-batch with gas 1, and between a
        # window's last step() of a micro-batch and the next one).
        e = self.engine(config())
        self.assertTrue(e.is_gradient_accumulation_boundary())
        e = self.engine(config({"gradient_accumulation_steps": 2}))
        seen = []
        for x, y in batches(4):
            seen.append(e.is_gradient_accumulation_boundary())
            e.backward(((e(x) - y) ** 2).mean())
            seen.append(e.is_gradient_accumulation_boundary())
            e.step()
        self.assertEqual(seen, [False, False, True, True] * 2)
        self.assertEqual(e.global_steps, 2)

    def test_deepspeed_cpu_adam_has_deepspeeds_signature_and_defaults(self):
        import inspect
        ds = deepspeed_module(self, "deepspeed.ops.adam")
        want = inspect.signature(ds.DeepSpeedCPUAdam.__init__).parameters
        got = inspect.signature(st.DeepSpeedCPUAdam.__init__).parameters
        self.assertEqual([(n, p.default) for n, p in want.items()],
                         [(n, p.default) for n, p in got.items() if p.kind != p.VAR_KEYWORD])
        # Positional as DeepSpeed's (lr, bias_correction, betas), weight decay 0 by default: torch.optim.AdamW's
        # update with weight_decay=0.
        torch.manual_seed(0)
        a = [torch.nn.Parameter(torch.randn(33)), torch.nn.Parameter(torch.randn(4, 5))]
        b = [torch.nn.Parameter(p.detach().clone()) for p in a]
        opt = st.DeepSpeedCPUAdam(a, 1e-2, True, (0.8, 0.99))
        ref = torch.optim.AdamW(b, lr=1e-2, betas=(0.8, 0.99), weight_decay=0.0)
        for _ in range(5):
            for p, q in zip(a, b):
                g = torch.randn_like(p)
                p.grad, q.grad = g.clone(), g.clone()
            opt.step()
            ref.step()
        for p, q in zip(a, b):
            torch.testing.assert_close(p, q, rtol=0, atol=1e-6)
        opt.close()


if __name__ == "__main__":
    unittest.main()
