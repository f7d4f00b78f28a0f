"""The DeepSpeed config's "scheduler" section (strata.torch.lr_schedules) against
DeepSpeed's own classes (deepspeed.runtime.lr_schedules, DeepSpeed 0.19.8).

- Every schedule type with several parameter sets: the param groups' learning
  rates after construction and after each of N steps equal DeepSpeed's, driven
  on a plain torch optimizer with two param groups, within 1e-12 relative
  (measured: 0, the same float operations).
- Through strata.torch.initialize: a config with a WarmupDecayLR section trains
  a Llama (parameters and optimizer on NVMe) like torch.optim.AdamW driven by
  DeepSpeed's WarmupDecayLR (test_torch_engine's tolerances); checkpoint resume
  continues the schedule; a step skipped for an fp16 overflow does not advance it.
- Refusals by name.

DeepSpeed is the reference: without it these tests skip, and fail under
STRATA_REQUIRE_REFERENCE=1 (CI installs deepspeed==0.19.8). Importing it after
torch takes about 0.2 s; DS_ACCELERATOR=cpu keeps its accelerator probe quiet.
"""
import copy
import logging
import os
import shutil
import tempfile
import unittest
import warnings

import torch

import strata.torch as st
from strata.torch import lr_schedules as sls

LR_TOL = 1e-12
N_STEPS = 40


def deepspeed_schedules(test):
    """deepspeed.runtime.lr_schedules, or skip (fail under STRATA_REQUIRE_REFERENCE=1)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        import deepspeed.runtime.lr_schedules as ds
    except Exception as e:  # ImportError, or a deepspeed that cannot start here
        if os.environ.get("STRATA_REQUIRE_REFERENCE") == "1":
            test.fail(f"deepspeed.runtime.lr_schedules does not import ({e!r}) and STRATA_REQUIRE_REFERENCE=1: "
                      "pip install deepspeed==0.19.8")
        test.skipTest(f"deepspeed is the reference and does not import: {e!r}")
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)  # its "before it has started" warnings
    return ds


def two_group_optimizer():
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))
    return torch.optim.AdamW([{"params": [a], "lr": 0.01}, {"params": [b], "lr": 0.02}], lr=0.01)


def lrs(opt):
    return [g["lr"] for g in opt.param_groups]


# (type, params) run for N_STEPS steps each; OneCycle with and without its
# momentum cycling (the betas are compared too).
CASES = [
    ("WarmupLR", {}),
    ("WarmupLR", {"warmup_min_lr": 1e-4, "warmup_max_lr": 1e-2, "warmup_num_steps": 10}),
    ("WarmupLR", {"warmup_min_lr": 1e-4, "warmup_max_lr": 1e-2, "warmup_num_steps": 10, "warmup_type": "linear"}),
    ("WarmupLR", {"warmup_min_lr": [0.0, 1e-3], "warmup_max_lr": [1e-2, 2e-2], "warmup_num_steps": 7,
                  "warmup_type": "log"}),
    ("WarmupLR", {"warmup_num_steps": 1, "warmup_type": "linear"}),  # counts as 2
    ("WarmupDecayLR", {"total_num_steps": 30}),
    ("WarmupDecayLR", {"total_num_steps": 30, "warmup_min_lr": 1e-5, "warmup_max_lr": 3e-3, "warmup_num_steps": 10}),
    ("WarmupDecayLR", {"total_num_steps": 25, "warmup_max_lr": [3e-3, 1e-3], "warmup_num_steps": 5,
                       "warmup_type": "linear"}),
    ("WarmupDecayLR", {"total_num_steps": 12, "warmup_num_steps": 12, "warmup_type": "linear"}),
    ("WarmupCosineLR", {"total_num_steps": 30}),
    ("WarmupCosineLR", {"total_num_steps": 30, "warmup_min_ratio": 0.1, "warmup_num_steps": 8,
                        "cos_min_ratio": 0.01}),
    ("WarmupCosineLR", {"total_num_steps": 33, "warmup_num_steps": 5, "warmup_type": "linear",
                        "cos_min_ratio": 0.2}),
    ("WarmupCosineLR", {"total_num_steps": 4, "warmup_num_steps": 6, "warmup_type": "linear"}),
    ("OneCycle", {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-2, "cycle_first_step_size": 10, "cycle_momentum": False}),
    ("OneCycle", {"cycle_min_lr": [1e-4, 2e-4], "cycle_max_lr": [1e-2, 3e-2], "cycle_first_step_size": 6,
                  "cycle_second_step_size": 9, "decay_lr_rate": 0.5, "decay_step_size": 4, "cycle_momentum": False}),
    ("OneCycle", {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-2, "cycle_first_step_size": 12, "cycle_second_step_size": 7,
                  "cycle_first_stair_count": 4, "cycle_second_stair_count": 3, "decay_step_size": 2,
                  "decay_lr_rate": 0.1, "cycle_momentum": False}),
    ("OneCycle", {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-2, "cycle_first_step_size": 8, "cycle_first_stair_count": 3,
                  "decay_lr_rate": 0.3, "cycle_momentum": False, "cycle_min_mom": 0.85}),
    ("OneCycle", {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-2, "cycle_first_step_size": 5, "cycle_second_step_size": 0,
                  "decay_lr_rate": 1.0, "decay_step_size": 1, "cycle_momentum": False}),
    ("OneCycle", {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-2, "cycle_first_step_size": 10}),
    ("OneCycle", {"cycle_min_lr": [1e-4, 2e-4], "cycle_max_lr": [1e-2, 3e-2], "cycle_first_step_size": 6,
                  "cycle_second_step_size": 9, "decay_lr_rate": 0.5, "decay_step_size": 4, "cycle_min_mom": [0.8, 0.85],
                  "cycle_max_mom": [0.95, 0.9], "decay_mom_rate": 0.01}),
    ("OneCycle", {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-2, "cycle_first_step_size": 12, "cycle_second_step_size": 7,
                  "cycle_first_stair_count": 4, "cycle_second_stair_count": 3, "decay_step_size": 2,
                  "decay_lr_rate": 0.1}),
    ("LRRangeTest", {}),
    ("LRRangeTest", {"lr_range_test_min_lr": [1e-4, 1e-3], "lr_range_test_step_size": 5,
                     "lr_range_test_step_rate": 2.0}),
    ("LRRangeTest", {"lr_range_test_min_lr": 1e-4, "lr_range_test_step_size": 3, "lr_range_test_step_rate": 0.5,
                     "lr_range_test_staircase": True}),
]


def rel(a, b):
    return abs(a - b) / abs(b) if b else abs(a)


class AgainstDeepSpeedTest(unittest.TestCase):
    def test_every_type_and_parameter_set_matches_deepspeed(self):
        ds = deepspeed_schedules(self)
        worst = 0.0
        for kind, params in CASES:
            with self.subTest(kind=kind, params=params), warnings.catch_warnings():
                warnings.simplefilter("ignore")  # total_num_steps < warmup_num_steps: both warn
                ours_opt, ref_opt = two_group_optimizer(), two_group_optimizer()
                ours = sls.from_config(ours_opt, {"type": kind, "params": params})
                ref = getattr(ds, kind)(ref_opt, **params)
                self.assertIsInstance(ours, sls.SCHEDULES[kind])
                for i in range(N_STEPS + 1):
                    for a, b in zip(lrs(ours_opt), lrs(ref_opt)):
                        worst = max(worst, rel(a, b))
                        self.assertLessEqual(rel(a, b), LR_TOL, f"{kind} {params}: lr after {i} steps: {a} vs {b}")
                    for ga, gb in zip(ours_opt.param_groups, ref_opt.param_groups):
                        self.assertEqual(tuple(ga["betas"]), tuple(gb["betas"]), f"{kind} {params}: betas after {i}")
                    if i:
                        self.assertEqual(ours.get_last_lr(), ref.get_last_lr())
                    self.assertEqual(ours.get_lr(), ref.get_lr())
                    self.assertEqual(ours.state_dict(), ref.state_dict())
                    ours.step()
                    ref.step()
        print(f"  {len(CASES)} schedules x {N_STEPS} steps: largest relative lr difference to DeepSpeed {worst:.1e}")

    def test_explicit_iteration_resume_and_state_dict(self):
        ds = deepspeed_schedules(self)
        for kind, params in CASES[1::3]:
            with self.subTest(kind=kind, params=params):
                ours_opt, ref_opt = two_group_optimizer(), two_group_optimizer()
                ours = sls.from_config(ours_opt, {"type": kind, "params": params})
                ref = getattr(ds, kind)(ref_opt, **params)
                for it in (5, 3, 17, 0, 29):  # step(n) jumps, as DeepSpeed's
                    ours.step(it)
                    ref.step(it)
                    self.assertEqual(lrs(ours_opt), lrs(ref_opt))
                # A schedule built for a resumed run leaves the lrs alone until it steps.
                sd = ours.state_dict()
                o2, r2 = two_group_optimizer(), two_group_optimizer()
                resumed = sls.from_config(o2, {"type": kind, "params": {**params, "last_batch_iteration": 11}})
                ref2 = getattr(ds, kind)(r2, **params, last_batch_iteration=11)
                self.assertEqual(lrs(o2), lrs(r2))
                resumed.load_state_dict(sd)
                ref2.load_state_dict(sd)
                for _ in range(4):
                    resumed.step()
                    ref2.step()
                    self.assertEqual(lrs(o2), lrs(r2))


class RefusalTest(unittest.TestCase):
    def refuse(self, section, pattern, optimizer=None):
        with self.assertRaisesRegex(ValueError, pattern):
            sls.from_config(optimizer or two_group_optimizer(), section)

    def test_refusals(self):
        self.refuse({"type": "StepLR", "params": {"step_size": 2}}, r"scheduler.type: 'StepLR' is not one of")
        self.refuse({"type": "WarmupLR", "params": {"warmup_steps": 10}},
                    r"scheduler.params.warmup_steps: not a parameter of WarmupLR")
        self.refuse({"type": "WarmupLR", "params": {}, "enabled": True}, r"unknown key 'enabled'")
        self.refuse({"type": "WarmupDecayLR", "params": {"total_num_steps": "auto"}},
                    r"scheduler.params.total_num_steps: \"auto\"")
        self.refuse({"type": "WarmupDecayLR", "params": {"warmup_num_steps": 10}},
                    r"scheduler.params.total_num_steps: required by WarmupDecayLR")
        self.refuse({"type": "OneCycle", "params": {"cycle_max_lr": 1e-2, "cycle_momentum": False}},
                    r"cycle_min_lr: required by OneCycle")
        self.refuse({"type": "WarmupLR", "params": {"warmup_type": "exp"}}, r"warmup_type 'exp'")
        self.refuse({"type": "WarmupLR", "params": {"warmup_num_steps": 10.0}}, r"warmup_num_steps must be a positive")
        self.refuse({"type": "WarmupLR", "params": {"warmup_max_lr": [1e-3, 1e-3, 1e-3]}},
                    r"warmup_max_lr has 3 values; the optimizer has 2 param groups")
        self.refuse({"type": "WarmupCosineLR", "params": {"total_num_steps": 10, "warmup_max_lr": 1e-3}},
                    r"warmup_max_lr: not a parameter of WarmupCosineLR.*ratios")
        # Momentum cycling needs an optimizer with betas (DeepSpeed warns and turns it off).
        sgd = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
        with self.assertRaisesRegex(ValueError, r"cycle_momentum=True needs an optimizer with betas"):
            sls.from_config(sgd, {"type": "OneCycle", "params": {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-2}})

    def test_initialize_refusals(self):
        from test_torch_engine import llama
        with self.assertRaisesRegex(ValueError, "both the config's \"scheduler\" section and lr_scheduler="):
            st.initialize(model=llama(), config={"scheduler": {"type": "WarmupLR", "params": {}}},
                          lr_scheduler=lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0))


class ThroughInitializeTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="strata-sched-test-", dir=os.environ.get("STRATA_TEST_DIR"))

    def tearDown(self):
        shutil.rmtree(self.dir, ignore_errors=True)

    def nvme(self, name):
        d = os.path.join(self.dir, name)
        os.makedirs(d, exist_ok=True)
        return d

    def test_warmup_decay_config_trains_like_torch_adamw_with_deepspeeds_scheduler(self):
        ds = deepspeed_schedules(self)
        from test_torch_engine import EngineTest, batches, ds_config, llama, strata_run, torch_run
        params = {"total_num_steps": 10, "warmup_min_lr": 1e-4, "warmup_max_lr": 3e-3, "warmup_num_steps": 4,
                  "warmup_type": "linear"}
        data = batches(16)
        ref = llama()
        init = copy.deepcopy(ref.state_dict())
        seen = []

        def ds_sched(opt):
            s = ds.WarmupDecayLR(opt, **params)
            seen.append(opt)
            return s
        l_torch = torch_run(ref, data, accum=2, clip=1.0, sched=ds_sched)
        m = llama()
        cfg = ds_config(self.nvme("a"), accum=2, clip=1.0, extra={"scheduler": {"type": "WarmupDecayLR",
                                                                                "params": params}})
        engine, opt, _, sched = st.initialize(model=m, config=cfg)
        self.assertIsInstance(sched, sls.WarmupDecayLR)
        self.assertIs(engine.lr_scheduler, sched)
        l_strata = strata_run(engine, data)
        self.assertEqual(engine.stats()["steps"], 8)
        self.assertEqual(lrs(opt), lrs(seen[0]))
        EngineTest.compare(self, "llama on NVMe, WarmupDecayLR from the config, accumulation 2", ref, init,
                           engine.state_dict(), l_strata, l_torch)
        engine.destroy()

    def test_one_cycle_with_momentum_trains_like_torch_adamw_with_deepspeeds_scheduler(self):
        # DeepSpeed's default OneCycle cycles betas[0] every step: the engine
        # takes each group's betas per step (strata_engine_set_group_betas).
        ds = deepspeed_schedules(self)
        from test_torch_engine import EngineTest, batches, ds_config, llama, torch_run
        params = {"cycle_min_lr": 1e-4, "cycle_max_lr": 3e-3, "cycle_first_step_size": 3, "cycle_min_mom": 0.8,
                  "cycle_max_mom": 0.95}
        data = batches(8)
        ref = llama()
        init = copy.deepcopy(ref.state_dict())
        l_torch = torch_run(ref, data, clip=1.0, sched=lambda opt: ds.OneCycle(opt, **params))
        engine, opt, _, sched = st.initialize(model=llama(), config=ds_config(self.nvme("oc"), clip=1.0, extra={
            "scheduler": {"type": "OneCycle", "params": params}}))
        from test_torch_engine import strata_run
        l_strata = strata_run(engine, data)
        self.assertNotEqual(tuple(opt.param_groups[0]["betas"]), (0.9, 0.999))
        EngineTest.compare(self, "llama on NVMe, OneCycle with momentum cycling", ref, init, engine.state_dict(),
                           l_strata, l_torch)
        engine.destroy()

    def test_checkpoint_resume_continues_the_schedule(self):
        from test_torch_engine import batches, ds_config, llama, strata_run
        cfg = lambda d: ds_config(self.nvme(d), extra={"scheduler": {"type": "WarmupCosineLR", "params": {  # noqa: E731
            "total_num_steps": 8, "warmup_num_steps": 3, "warmup_min_ratio": 0.1}}})
        data = batches(8)
        engine, _, _, sched = st.initialize(model=llama(), config=cfg("a"))
        straight = strata_run(engine, data)
        final, final_lrs = engine.state_dict(), engine.get_lr()
        engine.destroy()
        engine, _, _, sched = st.initialize(model=llama(), config=cfg("b"))
        first = strata_run(engine, data[:5])
        ck = os.path.join(self.dir, "ck")
        engine.save_checkpoint(ck)
        engine.destroy()
        engine, _, _, sched = st.initialize(model=llama(), config=cfg("c"))
        engine.load_checkpoint(ck)
        self.assertEqual(sched.state_dict(), {"last_batch_iteration": 4})
        rest = strata_run(engine, data[5:])
        self.assertEqual(first + rest, straight)
        self.assertEqual(engine.get_lr(), final_lrs)
        for k, v in engine.state_dict().items():
            self.assertTrue(torch.equal(v, final[k]), k)
        engine.destroy()

    def test_a_skipped_step_does_not_advance_the_schedule(self):
        from test_torch_engine import batches, ds_config, llama, strata_run
        # fp16 with a loss scale of 2^32: the first step overflows and is skipped.
        cfg = ds_config(None, extra={"fp16": {"enabled": True, "initial_scale_power": 32},
                                     "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 5,
                                                                                  "warmup_type": "linear"}}})
        engine, opt, _, sched = st.initialize(model=llama(), config=cfg)
        strata_run(engine, batches(1))
        self.assertTrue(engine.last_step["skipped"])
        self.assertEqual(sched.last_batch_iteration, -1)
        self.assertEqual(lrs(opt), [0.0])
        engine.destroy()


if __name__ == "__main__":
    unittest.main()
