"""strata.torch.CPUAdamW against torch.optim.AdamW / Adam (issue 12)."""
import unittest

import torch

import strata.torch as st
from strata import StrataError

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

    def test_refusals_name_what(self):
        p = [torch.nn.Parameter(torch.randn(4))]
        with self.assertRaisesRegex(ValueError, "bias_correction"):
            st.CPUAdamW(p, bias_correction=False)
        with self.assertRaisesRegex(TypeError, "fused"):
            st.CPUAdamW(p, fused=True)
        half = [torch.nn.Parameter(torch.randn(4).half())]
        o = st.CPUAdamW(half)
        half[0].grad = torch.randn(4).half()
        with self.assertRaisesRegex(ValueError, "fp32 CPU tensor"):
            o.step()
        o = st.CPUAdamW(p, betas=(1.5, 0.999))
        p[0].grad = torch.randn(4)
        with self.assertRaises(StrataError):
            o.step()


if __name__ == "__main__":
    unittest.main()
