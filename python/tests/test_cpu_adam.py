"""strata.torch.CPUAdamW against torch.optim.AdamW / Adam (issue 12), with its
optimizer states in RAM and on NVMe (a temporary directory here)."""
import copy
import gc
import os
import shutil
import tempfile
import unittest

import torch

import strata.torch as st
from strata import StrataError
from strata.torch import cpu_adam

TOL = 2e-6  # max |strata - torch| over weights of magnitude ~1 after 10 steps: fp32 rounding


def run(make_opt, steps=10, grad_dtype=torch.float32, seed=0, groups=None):
    torch.manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(257)), torch.nn.Parameter(torch.randn(33, 7))]
    opt = make_opt(groups(params) if groups else params)
    g = torch.Generator().manual_seed(seed + 1)
    for _ in range(steps):
        for p in params:
            grad = torch.randn(p.shape, generator=g).to(grad_dtype)
            if grad_dtype != torch.float32 and isinstance(opt, st.CPUAdamW):
                p.grad_dtype = None  # torch >= 2.10 checks a gradient's dtype against the parameter's
                p.grad = grad
            else:
                p.grad = grad.float()  # torch's AdamW takes fp32 gradients: the same values
        opt.step()
    return params, opt


def max_diff(a, b):
    return max((x - y).abs().max().item() for x, y in zip(a, b))


class CPUAdamWTest(unittest.TestCase):
    def test_matches_torch_adamw_with_param_groups(self):
        groups = lambda ps: [{"params": [ps[0]], "lr": 3e-3, "weight_decay": 0.1},  # noqa: E731
                             {"params": [ps[1]], "lr": 1e-2, "weight_decay": 0.0}]
        a, _ = run(lambda p: st.CPUAdamW(p, betas=(0.8, 0.95), eps=1e-6), groups=groups)
        b, _ = run(lambda p: torch.optim.AdamW(p, betas=(0.8, 0.95), eps=1e-6), groups=groups)
        d = max_diff(a, b)
        print(f"CPUAdamW vs torch.optim.AdamW, 10 steps, 2 param groups: max |diff| {d:.2e}")
        self.assertLessEqual(d, TOL)

    def test_amsgrad_maximize_and_bf16_gradients(self):
        for kw in ({"amsgrad": True}, {"maximize": True}):
            a, _ = run(lambda p: st.CPUAdamW(p, lr=1e-2, weight_decay=0.05, **kw))
            b, _ = run(lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.05, **kw))
            self.assertLessEqual(max_diff(a, b), TOL, kw)
        a, _ = run(lambda p: st.CPUAdamW(p, lr=1e-2), grad_dtype=torch.bfloat16)
        b, _ = run(lambda p: torch.optim.AdamW(p, lr=1e-2), grad_dtype=torch.bfloat16)
        self.assertLessEqual(max_diff(a, b), TOL)

    def test_adam_with_l2_decay_matches_torch_adam(self):
        a, _ = run(lambda p: st.CPUAdamW(p, lr=1e-2, weight_decay=0.1, adamw_mode=False))
        b, _ = run(lambda p: torch.optim.Adam(p, lr=1e-2, weight_decay=0.1))
        self.assertLessEqual(max_diff(a, b), TOL)

    def test_state_dict_moves_to_torch_and_back(self):
        a, oa = run(lambda p: st.CPUAdamW(p, lr=1e-2), steps=5)
        b, ob = run(lambda p: torch.optim.AdamW(p, lr=1e-2), steps=5)
        self.assertEqual(set(oa.state[a[0]].keys()), set(ob.state[b[0]].keys()))
        # Continue the Strata run in torch and the torch run in Strata: the same as not switching.
        ta = torch.optim.AdamW(a, lr=1e-2)
        ta.load_state_dict(oa.state_dict())
        sb = st.CPUAdamW(b, lr=1e-2)
        sb.load_state_dict(ob.state_dict())
        g = torch.Generator().manual_seed(9)
        for _ in range(3):
            for pa, pb in zip(a, b):
                pa.grad = torch.randn(pa.shape, generator=g)
                pb.grad = pa.grad.clone()
            ta.step()
            sb.step()
        self.assertLessEqual(max_diff(a, b), TOL)

    def test_bf16_states(self):
        a, oa = run(lambda p: st.CPUAdamW(p, lr=1e-2, fp32_optimizer_states=False))
        self.assertEqual(oa.state[a[0]]["exp_avg"].dtype, torch.bfloat16)
        b, _ = run(lambda p: torch.optim.AdamW(p, lr=1e-2))
        self.assertLessEqual(max_diff(a, b), 5e-3)  # bf16 moments: ~3 significant digits

    def test_groups_from_elsewhere_step_whole_or_not_at_all(self):
        # A DeepSpeed DeepSpeedCPUAdam state_dict (groups without "maximize",
        # with "bias_correction") loads and steps as torch's optimizers fill
        # missing keys; a group with bias_correction False is refused, not
        # stepped with it; a bad hyper-parameter in a later group leaves the
        # earlier groups unstepped (a retry would step them twice).
        a, b = torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(4))
        o = st.CPUAdamW([{"params": [a]}, {"params": [b]}], weight_decay=0.0)
        sd = o.state_dict()
        for g in sd["param_groups"]:
            del g["maximize"]
            g["bias_correction"] = True
        o.load_state_dict(sd)
        a.grad, b.grad = torch.ones(4), torch.ones(4)
        o.step()
        ref = torch.nn.Parameter(torch.ones(4))
        ref.grad = torch.ones(4)
        t = torch.optim.AdamW([ref], weight_decay=0.0)
        t.step()
        self.assertTrue(torch.equal(a.detach(), ref.detach()))
        o.param_groups[1]["bias_correction"] = False
        with self.assertRaisesRegex(ValueError, r"param_groups\[1\] has bias_correction=False"):
            o.step()
        o.param_groups[1]["bias_correction"] = True
        o.param_groups[1]["eps"] = -1.0
        before = a.detach().clone()
        with self.assertRaisesRegex(StrataError, r"param_groups\[1\] \(its hyper-parameters\).*eps"):
            o.step()
        self.assertTrue(torch.equal(a.detach(), before))
        self.assertEqual(float(o.state[a]["step"]), 1.0)
        o.param_groups[1]["eps"] = 1e-8
        o.param_groups[0]["lr"] = 1e39  # past fp32: became inf and NaN weights, status OK
        with self.assertRaisesRegex(StrataError, "invalid learning rate 1e\\+39"):
            o.step()
        o.close()

    def test_a_later_groups_bad_state_leaves_every_group_unstepped(self):
        # A state_dict from elsewhere whose second group's moments have the
        # wrong shape, or lack max_exp_avg_sq under amsgrad (as torch, which
        # raises KeyError), is refused before the first group moves.
        a, b = torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(6))
        o = st.CPUAdamW([{"params": [a]}, {"params": [b]}], lr=1e-2)
        a.grad, b.grad = torch.ones(4), torch.ones(6)
        o.step()
        a0, b0 = a.detach().clone(), b.detach().clone()
        good = o.state[b]["exp_avg"]
        o.state[b]["exp_avg"] = torch.zeros(5)
        with self.assertRaisesRegex(ValueError, r"param_groups\[1\]\['params'\]\[0\].*'exp_avg' must be"):
            o.step()
        self.assertTrue(torch.equal(a.detach(), a0))
        self.assertEqual(float(o.state[a]["step"]), 1.0)
        o.state[b]["exp_avg"] = good
        o.param_groups[1]["amsgrad"] = True
        with self.assertRaisesRegex(ValueError, r"param_groups\[1\].*no 'max_exp_avg_sq' \(a state saved with amsgrad"):
            o.step()
        self.assertTrue(torch.equal(a.detach(), a0) and torch.equal(b.detach(), b0))
        self.assertEqual(float(o.state[a]["step"]), 1.0)
        o.param_groups[1]["amsgrad"] = False
        # A step the kernel cannot take (below 0, fractional, past int64, not
        # finite) is refused by name before any parameter moves, too.
        good_step = o.state[b]["step"]
        for bad in (torch.tensor(-1.0), 2.5, 2.0 ** 63, float("inf"), torch.tensor([1.0, 2.0])):
            o.state[b]["step"] = bad
            with self.assertRaisesRegex(ValueError, r"param_groups\[1\].*optimizer state's step is"):
                o.step()
            self.assertTrue(torch.equal(a.detach(), a0))
            self.assertEqual(float(o.state[a]["step"]), 1.0)
        o.state[b]["step"] = good_step
        o.step()  # the same step, taken once
        self.assertEqual(float(o.state[a]["step"]), 2.0)
        self.assertEqual(float(o.state[b]["step"]), 2.0)
        o.close()

    def test_a_channels_last_state_from_torch_loads_and_steps_as_torch(self):
        # torch.optim.AdamW keeps a channels_last parameter's moments
        # channels_last; loaded into CPUAdamW they step as in torch.
        w = torch.nn.Parameter(torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last))
        t = torch.optim.AdamW([w], lr=1e-2)
        w.grad = torch.randn(w.shape).to(memory_format=torch.channels_last)
        t.step()
        self.assertFalse(t.state[w]["exp_avg"].is_contiguous())
        a = torch.nn.Parameter(w.detach().contiguous().clone())
        o = st.CPUAdamW([a], lr=1e-2)
        o.load_state_dict(copy.deepcopy(t.state_dict()))  # as from a file: torch's load keeps the tensors it can
        g = torch.randn(w.shape)
        w.grad, a.grad = g.to(memory_format=torch.channels_last), g.clone()
        t.step()
        o.step()
        self.assertLessEqual((a.detach() - w.detach()).abs().max().item(), TOL)
        o.close()

    def test_a_groups_decoupled_weight_decay_as_torch(self):
        # torch 2 reads decoupled_weight_decay per group (AdamW's decay or Adam's L2).
        for adamw_mode, ref in ((True, torch.optim.AdamW), (False, torch.optim.Adam)):
            groups = lambda ps: [{"params": [ps[0]], "decoupled_weight_decay": not adamw_mode},  # noqa: E731
                                 {"params": [ps[1]]}]
            a, o = run(lambda p: st.CPUAdamW(p, lr=1e-2, weight_decay=0.5, adamw_mode=adamw_mode), groups=groups)
            b, _ = run(lambda p: ref(p, lr=1e-2, weight_decay=0.5), groups=groups)
            self.assertLessEqual(max_diff(a, b), TOL, adamw_mode)
            self.assertEqual([g["decoupled_weight_decay"] for g in o.param_groups], [not adamw_mode, adamw_mode])
            # Loaded: AdamW forces decoupled decay on every group, Adam keeps a group's (as torch's load does).
            o.load_state_dict(o.state_dict())
            self.assertEqual([g["decoupled_weight_decay"] for g in o.param_groups],
                             [True, True] if adamw_mode else [True, False])
            o.close()

    def test_duplicates_and_copies_are_refused(self):
        w = torch.nn.Parameter(torch.randn(4))
        with self.assertRaisesRegex(ValueError, "more than once"):
            st.CPUAdamW([w, w])
        o = st.CPUAdamW([torch.nn.Parameter(torch.randn(4))])
        with self.assertRaisesRegex(ValueError, "more than once"):
            o.add_param_group({"params": [w, w]})
        for copy_it in (copy.deepcopy, copy.copy, lambda x: __import__("pickle").dumps(x)):
            with self.assertRaisesRegex(TypeError, "cannot be pickled or copied.*state_dict"):
                copy_it(o)
        o.close()

    def test_refusals_name_what(self):
        p = [torch.nn.Parameter(torch.randn(4))]
        with self.assertRaisesRegex(ValueError, "bias_correction"):
            st.CPUAdamW(p, bias_correction=False)
        with self.assertRaisesRegex(TypeError, "capturable=True"):
            st.CPUAdamW(p, capturable=True)
        with self.assertRaisesRegex(TypeError, "differentiable=True"):
            st.CPUAdamW(p, differentiable=True)
        with self.assertRaisesRegex(TypeError, "no_such_option"):
            st.CPUAdamW(p, no_such_option=1)
        # torch's kernel choices (not its math) are taken as torch takes them.
        for kw in ({"foreach": False}, {"foreach": True}, {"fused": False}, {"fused": True}, {"capturable": False}):
            st.CPUAdamW(p, **kw).close()
        # What torch.optim.AdamW refuses at construction, refused there too.
        half = [torch.nn.Parameter(torch.randn(4).half())]
        with self.assertRaisesRegex(ValueError, r"param_groups\[0\]\['params'\]\[0\].*torch.float16.*fp32 CPU"):
            st.CPUAdamW(half)
        o = st.CPUAdamW(p)
        with self.assertRaisesRegex(ValueError, "fp32 CPU"):
            o.add_param_group({"params": half})
        self.assertEqual(len(o.param_groups), 1)
        for kw, what in (({"betas": (1.5, 0.999)}, "beta parameter at index 0"), ({"eps": -1.0}, "epsilon"),
                         ({"weight_decay": -0.1}, "weight_decay")):
            with self.assertRaisesRegex(ValueError, what):
                st.CPUAdamW(p, **kw)
        # Edited afterwards: the library refuses the step.
        o.param_groups[0]["betas"] = (1.5, 0.999)
        p[0].grad = torch.randn(4)
        with self.assertRaises(StrataError):
            o.step()


def nvme_run(make, steps=8, grad_dtype=torch.float32, none=((2, 1), (5, 2)), seed=0, change=None):
    """Four parameters (a scalar among them) in two groups; `none`: (step, param) pairs whose
    gradient is None; change(step, params): edits the weights between steps."""
    torch.manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(257)), torch.nn.Parameter(torch.randn(33, 7)),
              torch.nn.Parameter(torch.randn(40, 25)), torch.nn.Parameter(torch.randn(()))]
    opt = make(params)
    g = torch.Generator().manual_seed(seed + 1)
    for s in range(steps):
        if change is not None:
            change(s, params)
        for i, p in enumerate(params):
            grad = torch.randn(p.shape, generator=g).to(grad_dtype)
            if (s, i) in none:
                p.grad = None
            elif grad_dtype != torch.float32 and isinstance(opt, st.CPUAdamW):
                p.grad_dtype = None
                p.grad = grad
            else:
                p.grad = grad.float()
        opt.step()
    return params, opt


def two_groups(ps, **g1):
    return [{"params": ps[:2], "lr": 3e-3, "weight_decay": 0.1},
            {"params": ps[2:], "lr": 1e-2, "weight_decay": 0.0, **g1}]


def states_equal(test, a, b):
    """Two state dicts: the same keys, steps and bit-identical tensors."""
    test.assertEqual(sorted(a["state"]), sorted(b["state"]))
    for k in a["state"]:
        sa, sb = a["state"][k], b["state"][k]
        test.assertEqual(sorted(sa), sorted(sb), k)
        for key in sa:
            test.assertEqual(sa[key].dtype, sb[key].dtype, (k, key))
            test.assertTrue(torch.equal(sa[key], sb[key]), (k, key))


class CPUAdamWNvmeTest(unittest.TestCase):
    """nvme_path=: the moments in a Strata engine's swap files. Buckets of 300
    elements here, so parameters both share engine tensors and have their own."""

    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="strata-test-cpuadam-")
        self._bucket = cpu_adam._BUCKET_ELEMS
        cpu_adam._BUCKET_ELEMS = 300

    def tearDown(self):
        cpu_adam._BUCKET_ELEMS = self._bucket
        gc.collect()
        left = os.listdir(self.dir)
        shutil.rmtree(self.dir, ignore_errors=True)
        self.assertEqual(left, [], "an optimizer's NVMe directory outlived it")

    def nvme(self, params, **kw):
        return st.CPUAdamW(params, nvme_path=self.dir, **kw)

    def test_a_loaded_step_it_cannot_take_is_refused_before_anything_changes(self):
        a = torch.nn.Parameter(torch.ones(8))
        o = self.nvme([a], lr=1e-2)
        a.grad = torch.ones(8)
        o.step()
        sd = copy.deepcopy(o.state_dict())
        for bad in (float("inf"), -3.0, 0.5):
            bad_sd = copy.deepcopy(sd)
            bad_sd["state"][0]["step"] = torch.tensor(bad)
            with self.assertRaisesRegex(ValueError, r"the loaded state: its optimizer state's step is"):
                o.load_state_dict(bad_sd)
        o.step()  # untouched: the second step, from the first's moments
        self.assertEqual(float(o.state[a]["step"]), 2.0)
        o.close()

    def test_equals_ram_mode_and_torch_adamw(self):
        # Two groups (lr, weight decay, amsgrad differ), None gradients in two steps.
        kw = dict(betas=(0.8, 0.95), eps=1e-6)
        a, oa = nvme_run(lambda p: self.nvme(two_groups(p, amsgrad=True), **kw))
        self.assertTrue(os.listdir(oa.nvme_dir))
        b, ob = nvme_run(lambda p: st.CPUAdamW(two_groups(p, amsgrad=True), **kw))
        c, oc = nvme_run(lambda p: torch.optim.AdamW(two_groups(p, amsgrad=True), **kw))
        for x, y in zip(a, b):
            self.assertTrue(torch.equal(x, y), "NVMe mode differs from RAM mode")
        d = max_diff(a, c)
        print(f"CPUAdamW NVMe mode vs RAM mode: bit-identical; vs torch.optim.AdamW, 8 steps, 2 groups, "
              f"amsgrad, None grads: max |diff| {d:.2e}")
        self.assertLessEqual(d, TOL)
        sa, sc = oa.state_dict(), oc.state_dict()
        states_equal(self, sa, ob.state_dict())
        self.assertEqual(sorted(sa["state"]), sorted(sc["state"]))
        for k in sc["state"]:  # per-parameter steps as torch counts them (None grads skipped)
            self.assertEqual(sorted(sa["state"][k]), sorted(sc["state"][k]))
            self.assertEqual(float(sa["state"][k]["step"]), float(sc["state"][k]["step"]), k)
        self.assertEqual(float(sa["state"][1]["step"]), 7.0)
        oa.close()

    def test_adam_l2_maximize_bf16_gradients_and_states(self):
        for kw, grad_dtype in (({"adamw_mode": False, "weight_decay": 0.1}, torch.float32),
                               ({"maximize": True, "weight_decay": 0.05}, torch.bfloat16),
                               ({"fp32_optimizer_states": False}, torch.float16)):
            a, oa = nvme_run(lambda p: self.nvme(p, lr=1e-2, **kw), grad_dtype=grad_dtype)
            b, ob = nvme_run(lambda p: st.CPUAdamW(p, lr=1e-2, **kw), grad_dtype=grad_dtype)
            for x, y in zip(a, b):
                self.assertTrue(torch.equal(x, y), kw)
            states_equal(self, oa.state_dict(), ob.state_dict())
            oa.close()

    def test_state_dict_moves_between_nvme_ram_and_torch(self):
        groups = lambda p: two_groups(p, amsgrad=True)  # noqa: E731
        ref, oref = nvme_run(lambda p: self.nvme(groups(p)), steps=8)  # uninterrupted
        makers = {"nvme": lambda p: self.nvme(groups(p)), "ram": lambda p: st.CPUAdamW(groups(p)),
                  "torch": lambda p: torch.optim.AdamW(groups(p))}
        for src in makers:
            for dst in makers:
                if src == dst == "torch":
                    continue
                a, oa = nvme_run(makers[src], steps=4)
                sd = oa.state_dict()
                if isinstance(oa, st.CPUAdamW):
                    oa.close()
                ob = makers[dst](a)
                ob.load_state_dict(sd)
                if dst != "torch":
                    states_equal(self, ob.state_dict(), sd)
                g = torch.Generator().manual_seed(1)  # the same gradients as nvme_run's steps 4..7
                for s in range(8):
                    for i, p in enumerate(a):
                        grad = torch.randn(p.shape, generator=g)
                        if s >= 4:
                            p.grad = None if (s, i) == (5, 2) else grad
                    if s >= 4:
                        ob.step()
                if "torch" in (src, dst):
                    self.assertLessEqual(max_diff(a, ref), TOL, (src, dst))
                else:
                    for x, y in zip(a, ref):
                        self.assertTrue(torch.equal(x, y), (src, dst))
                    states_equal(self, ob.state_dict(), oref.state_dict())
                if isinstance(ob, st.CPUAdamW):
                    ob.close()
        oref.close()

    def test_state_dict_is_a_snapshot(self):
        a, oa = nvme_run(lambda p: self.nvme(p), steps=3, none=())
        sd = oa.state_dict()
        oa.step()
        self.assertEqual(float(sd["state"][0]["step"]), 3.0)
        o2 = self.nvme(a)
        o2.load_state_dict(sd)
        o2.step()
        self.assertEqual(float(sd["state"][0]["step"]), 3.0)
        oa.close()
        o2.close()

    def test_bf16_states_keep_their_dtype_across_modes(self):
        a, oa = nvme_run(lambda p: self.nvme(p, fp32_optimizer_states=False), steps=3)
        sd = oa.state_dict()
        self.assertEqual(sd["state"][0]["exp_avg"].dtype, torch.bfloat16)
        ram = st.CPUAdamW(a, fp32_optimizer_states=False)
        ram.load_state_dict(sd)
        self.assertEqual(ram.state[a[0]]["exp_avg"].dtype, torch.bfloat16)
        states_equal(self, ram.state_dict(), sd)
        oa.close()

    def test_weights_changed_between_steps(self):
        # The torch parameter is the master in both modes: edits through .data,
        # in place under no_grad, or a new .data tensor are what the next step updates.
        def change(s, ps):
            if s == 3:
                ps[0].data.mul_(0.5)
                with torch.no_grad():
                    ps[3].fill_(2.0)
            if s == 5:
                ps[1].data = torch.full((33, 7), 0.25)
        a, oa = nvme_run(lambda p: self.nvme(two_groups(p)), change=change)
        b, _ = nvme_run(lambda p: st.CPUAdamW(two_groups(p)), change=change)
        for x, y in zip(a, b):
            self.assertTrue(torch.equal(x, y))
        oa.close()

    def test_state_dropped_by_hand_starts_over(self):
        # As torch: a parameter whose state is removed starts again from zero moments and step 1.
        def run(make):
            ps, o = nvme_run(make, steps=3, none=())
            del o.state[ps[1]]
            o.state[ps[2]].clear()
            for p in ps:
                p.grad = torch.ones(p.shape)
            o.step()
            return ps, o
        a, oa = run(lambda p: self.nvme(two_groups(p, amsgrad=True)))
        b, ob = run(lambda p: st.CPUAdamW(two_groups(p, amsgrad=True)))
        for x, y in zip(a, b):
            self.assertTrue(torch.equal(x, y))
        states_equal(self, oa.state_dict(), ob.state_dict())
        self.assertEqual(float(oa.state_dict()["state"][1]["step"]), 1.0)
        oa.close()

    def test_add_param_group_and_a_resized_parameter(self):
        def run(make):
            torch.manual_seed(3)
            ps = [torch.nn.Parameter(torch.randn(100)), torch.nn.Parameter(torch.randn(500))]
            o = make([ps[0]])
            for s in range(5):
                if s == 2:
                    o.add_param_group({"params": [ps[1]], "lr": 5e-3, "amsgrad": True})
                for p in ps:
                    p.grad = torch.randn(p.shape)
                o.step()
            return ps, o
        a, oa = run(lambda p: self.nvme(p))
        b, ob = run(lambda p: st.CPUAdamW(p))
        for x, y in zip(a, b):
            self.assertTrue(torch.equal(x, y))
        states_equal(self, oa.state_dict(), ob.state_dict())
        a[1].data = torch.randn(400)
        a[1].grad = torch.randn(400)
        with self.assertRaisesRegex(ValueError, r"param_groups\[1\]\['params'\]\[0\].*400 elements, its optimizer "
                                                r"state 500"):
            oa.step()
        oa.close()

    def test_files_go_with_the_optimizer(self):
        p = [torch.nn.Parameter(torch.randn(1000))]
        o = self.nvme(p)
        path = o.nvme_dir
        self.assertTrue(os.path.isdir(path))
        o.close()
        self.assertFalse(os.path.exists(path))
        self.assertIsNone(o.nvme_dir)
        p[0].grad = torch.randn(1000)
        with self.assertRaisesRegex(RuntimeError, "closed"):
            o.step()
        o.close()  # idempotent
        o = self.nvme(p)
        path = o.nvme_dir
        o.step()
        del o
        gc.collect()
        self.assertFalse(os.path.exists(path))
        with self.nvme(p) as o:
            path = o.nvme_dir
            o.step()
        self.assertFalse(os.path.exists(path))

    def test_deepspeed_offload_optimizer_section(self):
        sub = os.path.join(self.dir, "not-yet")  # created, as DeepSpeed's swapper does
        section = {"device": "nvme", "nvme_path": sub, "pin_memory": True, "buffer_count": 4, "fast_init": False}
        a, oa = nvme_run(lambda p: st.CPUAdamW(p, offload_optimizer=section, aio={"queue_depth": 8}), steps=3)
        b, _ = nvme_run(lambda p: st.CPUAdamW(p, offload_optimizer={"device": "cpu"}), steps=3)
        for x, y in zip(a, b):
            self.assertTrue(torch.equal(x, y))
        self.assertTrue(oa.nvme_dir.startswith(sub))
        oa.close()
        self.assertEqual(os.listdir(sub), [])
        os.rmdir(sub)  # nvme_path itself is the user's

    def test_state_dict_hooks_see_the_moments(self):
        # torch runs state_dict's post-hooks on the whole dict, and load_state_dict's pre-hooks before it reads it.
        p = [torch.nn.Parameter(torch.randn(5))]
        o = self.nvme(p)
        p[0].grad = torch.randn(5)
        o.step()
        seen = []
        o.register_state_dict_post_hook(lambda opt, sd: seen.append(sorted(sd["state"][0])))
        o.register_state_dict_post_hook(lambda opt, sd: {**sd, "marked": True})
        sd = o.state_dict()
        self.assertEqual(seen, [["exp_avg", "exp_avg_sq", "step"]])
        self.assertTrue(sd.get("marked"))
        sd.pop("marked")
        renamed = {**sd, "state": {0: {"step": sd["state"][0]["step"], "m": sd["state"][0]["exp_avg"],
                                       "exp_avg_sq": sd["state"][0]["exp_avg_sq"]}}}

        def fix(opt, d):
            st0 = dict(d["state"][0])
            st0["exp_avg"] = st0.pop("m")
            return {**d, "state": {0: st0}}
        loaded = []
        o2 = self.nvme([torch.nn.Parameter(p[0].detach().clone())])
        o2.register_load_state_dict_pre_hook(fix)
        o2.register_load_state_dict_post_hook(lambda opt: loaded.append(sorted(opt.state_dict()["state"][0])))
        o2.load_state_dict(renamed)
        self.assertEqual(loaded, [["exp_avg", "exp_avg_sq", "step"]])
        self.assertTrue(torch.equal(o2.state_dict()["state"][0]["exp_avg"], sd["state"][0]["exp_avg"]))
        o.close()
        o2.close()

    def test_refusals_name_what(self):
        p = [torch.nn.Parameter(torch.randn(4))]
        with self.assertRaisesRegex(ValueError, r"param_groups\[0\]\['params'\]\[1\].*torch.float16"):
            self.nvme([p[0], torch.nn.Parameter(torch.randn(4).half())])
        with self.assertRaisesRegex(ValueError, "device 'none'"):
            st.CPUAdamW(p, offload_optimizer={"device": "none"})
        with self.assertRaisesRegex(ValueError, r"unknown key\(s\) \['nvme_pth'\]"):
            st.CPUAdamW(p, offload_optimizer={"device": "nvme", "nvme_pth": self.dir})
        with self.assertRaisesRegex(ValueError, "differ"):
            st.CPUAdamW(p, nvme_path=self.dir, offload_optimizer={"device": "nvme", "nvme_path": "/elsewhere"})
        with self.assertRaisesRegex(ValueError, "needs an nvme_path"):
            st.CPUAdamW(p, offload_optimizer={"device": "nvme"})
        with self.assertRaisesRegex(ValueError, "aio="):
            st.CPUAdamW(p, aio={"queue_depth": 8})
        st.CPUAdamW(p, offload_optimizer={"device": "cpu"}, aio={"queue_depth": 8})  # DeepSpeed's sections as they are
        # The library's own message: a bad key in the engine's config ...
        with self.assertRaisesRegex(StrataError, r"aio\.queue_dept.*unknown key.*INVALID_ARGUMENT"):
            self.nvme(p, aio={"queue_dept": 8})
        # ... and the kernel's, for hyper-parameters torch would reject (nothing is changed).
        # Checked for every group before any parameter moves.
        q = [torch.nn.Parameter(torch.randn(4)), torch.nn.Parameter(torch.randn(5))]
        o = self.nvme([{"params": q[:1]}, {"params": q[1:], "betas": (1.5, 0.999)}])
        before = [x.detach().clone() for x in q]
        for x in q:
            x.grad = torch.randn(x.shape)
        with self.assertRaisesRegex(StrataError, r"param_groups\[1\] \(its hyper-parameters\).*beta1"):
            o.step()
        for x, y in zip(q, before):
            self.assertTrue(torch.equal(x, y))
            self.assertEqual(len(o.state[x]), 0)
        o.close()
        # A failed write of the moments says the weights moved without them.
        o = self.nvme(p)

        def broken(t, k, src):
            raise StrataError(2, "engine: load_state(states0, 0): write failed: Input/output error")
        o._store.write = broken
        p[0].grad = torch.randn(4)
        with self.assertRaisesRegex(StrataError, r"param_groups\[0\]\['params'\]\[0\].*updated, but their "
                                                 r"optimizer state could not be written.*Input/output error \[IO\]$"):
            o.step()
        o.close()
        # An I/O error in the second piece of a parameter cut in two: the error says it moved in part;
        # a parameter done before keeps its step.
        q = [torch.nn.Parameter(torch.randn(10)), torch.nn.Parameter(torch.randn(500))]
        o = self.nvme(q)
        for x in q:
            x.grad = torch.randn(x.shape)
        read = o._store.read

        def failing(t, k, dst):
            if t == 2:
                raise StrataError(2, "engine: read_state(states2, 0): read failed: Input/output error")
            read(t, k, dst)
        o._store.read = failing
        with self.assertRaisesRegex(StrataError, r"Input/output error; this step stopped part-way: "
                                                 r"CPUAdamW: param_groups\[0\]\['params'\]\[1\] \(shape \(500,\)\) "
                                                 r"updated in part.*\[IO\]$"):
            o.step()
        self.assertEqual(float(o.state[q[0]]["step"]), 1.0)
        self.assertEqual(len(o.state[q[1]]), 0)
        o.close()
        # amsgrad turned on for a parameter whose state began without it (torch fails too).
        o = self.nvme(p)
        o.step()
        o.param_groups[0]["amsgrad"] = True
        with self.assertRaisesRegex(ValueError, "max_exp_avg_sq"):
            o.step()
        o.close()


if __name__ == "__main__":
    unittest.main()
