"""DeepSpeed's learning-rate schedules (deepspeed.runtime.lr_schedules) for the
optimizer strata.torch.initialize returns, so a DeepSpeed config's
"scheduler" section ports unchanged:

    "scheduler": {"type": "WarmupDecayLR",
                  "params": {"total_num_steps": 1000, "warmup_max_lr": 2e-5, "warmup_num_steps": 100}}

Types: WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest, with
DeepSpeed's parameter names, defaults and formulas (DeepSpeed 0.19.8; the
tests compare every learning rate with DeepSpeed's own classes). Each sets
the "lr" of the optimizer's param_groups: at construction (the lr of the
first optimizer step, unless last_batch_iteration is given) and at each
step(), which strata.torch's engine calls after each optimizer step (as
DeepSpeed's engine does; not after a step the engine skipped for non-finite
gradients). API: step(), get_lr(), get_last_lr(), state_dict(),
load_state_dict(); the state is {"last_batch_iteration": n}, as DeepSpeed's.

Where this differs from DeepSpeed, it refuses instead of guessing:
- an unknown "type" (DeepSpeed also accepts torch.optim.lr_scheduler class
  names there; with Strata pass such a scheduler as initialize(lr_scheduler=)),
  an unknown key in the section or in "params", a missing required parameter
  (WarmupDecayLR/WarmupCosineLR total_num_steps, OneCycle cycle_min_lr and
  cycle_max_lr), and "auto" values (a Hugging Face Trainer convention:
  strata.torch.StrataTrainer fills them in) are ValueErrors naming the key;
- an unknown warmup_type is refused (DeepSpeed logs a warning and uses "log");
- OneCycle's cycle_momentum=True (DeepSpeed's default) cycles each param
  group's betas[0] as DeepSpeed does; the engine takes them per step
  (strata_engine_set_group_betas). An optimizer without betas in its defaults
  is refused (DeepSpeed logs a warning and turns the cycling off).
"""
import inspect
import math
import warnings

import torch

__all__ = ["WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest", "from_config", "SCHEDULES"]

_LOG, _LINEAR = "log", "linear"


def _torch_optimizer(optimizer, who):
    # As DeepSpeed: a torch optimizer, or a wrapper holding one in .optimizer.
    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    inner = getattr(optimizer, "optimizer", None)
    if isinstance(inner, torch.optim.Optimizer):
        return inner
    raise TypeError(f"{who}: {type(optimizer).__name__} is not a torch.optim.Optimizer")


def _per_group(optimizer, value, name, who):
    """A scalar for every param group, or a list with one value per group."""
    n = len(optimizer.param_groups)
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(f"{who}: {name} has {len(value)} values; the optimizer has {n} param groups")
        return list(value)
    return [value] * n


def _positive_int(value, name, who):
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{who}: {name} must be a positive integer, got {value!r}")
    return value


def _number(value, name, who):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{who}: {name} must be a number, got {value!r}")
    return value


def _warmup_type(value, who):
    if value not in (_LOG, _LINEAR):
        raise ValueError(f"{who}: warmup_type {value!r} is not \"log\" or \"linear\" (DeepSpeed would fall back to "
                         "\"log\" with a warning; say which you mean)")
    return value


def _set_lrs(optimizer, lrs):
    """Writes one lr per param group (a tensor lr is filled in place) and returns the groups' lrs."""
    for group, lr in zip(optimizer.param_groups, lrs):
        if torch.is_tensor(group["lr"]):
            group["lr"].fill_(lr.squeeze() if torch.is_tensor(lr) else lr)
        else:
            group["lr"] = lr
    return [group["lr"] for group in optimizer.param_groups]


class _Schedule:
    """What the five schedules share: the batch counter, step() and the state."""

    def __init__(self, optimizer, last_batch_iteration):
        self.optimizer = _torch_optimizer(optimizer, type(self).__name__)
        self.last_batch_iteration = last_batch_iteration
        self._last_lr = None

    def _start(self):
        # A fresh schedule (last_batch_iteration -1) sets the lr of the first
        # optimizer step now; a resumed one leaves the lrs to its next step().
        if self.last_batch_iteration == -1:
            self._last_lr = _set_lrs(self.optimizer, self.get_lr())

    def get_lr(self):
        """The learning rates (one per param group) for batch last_batch_iteration + 1."""
        raise NotImplementedError

    def step(self, last_batch_iteration=None):
        """Advances to the next batch (or to last_batch_iteration) and sets the param groups' lrs."""
        self.last_batch_iteration = self.last_batch_iteration + 1 if last_batch_iteration is None \
            else last_batch_iteration
        self._last_lr = _set_lrs(self.optimizer, self.get_lr())

    def get_last_lr(self):
        """The learning rates the last step() (or the construction) set."""
        if self._last_lr is None:
            raise RuntimeError(f"{type(self).__name__}: need to call step() first")
        return self._last_lr

    def state_dict(self):
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, sd):
        """Restores the batch counter; the param groups' lrs are the optimizer's (restored with it)."""
        self.last_batch_iteration = sd["last_batch_iteration"]


class WarmupLR(_Schedule):
    """From warmup_min_lr to warmup_max_lr over warmup_num_steps steps, then warmup_max_lr.

    At batch i < warmup_num_steps the lr is min + (max - min) * gamma with gamma =
    log(i + 1) / log(warmup_num_steps) ("log") or i / warmup_num_steps ("linear");
    warmup_num_steps below 2 counts as 2, as in DeepSpeed. warmup_min_lr and
    warmup_max_lr may be one value per param group; warmup_max_lr None (the
    default) is each group's lr at construction.
    """

    def __init__(self, optimizer, warmup_min_lr=0.0, warmup_max_lr=None, warmup_num_steps=1000,
                 warmup_type=_LOG, last_batch_iteration=-1):
        who = type(self).__name__
        _positive_int(warmup_num_steps, "warmup_num_steps", who)
        super().__init__(optimizer, last_batch_iteration)
        if warmup_max_lr is None:
            warmup_max_lr = [g["lr"] for g in self.optimizer.param_groups]
        self.min_lrs = _per_group(self.optimizer, warmup_min_lr, "warmup_min_lr", who)
        self.max_lrs = _per_group(self.optimizer, warmup_max_lr, "warmup_max_lr", who)
        self.delta_lrs = [hi - lo for hi, lo in zip(self.max_lrs, self.min_lrs)]
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.warmup_type = _warmup_type(warmup_type, who)
        self.inverse_log_warm_up = 1.0 / math.log(self.warmup_num_steps)
        self._start()

    def _warmup_gamma(self):
        i = self.last_batch_iteration
        if self.warmup_type == _LOG:
            return self.inverse_log_warm_up * math.log(i + 1)
        return i / self.warmup_num_steps

    def _gamma(self):
        return self._warmup_gamma() if self.last_batch_iteration < self.warmup_num_steps else 1.0

    def get_lr(self):
        if self.last_batch_iteration < 0:
            return list(self.min_lrs)
        gamma = self._gamma()
        return [lo + delta * gamma for lo, delta in zip(self.min_lrs, self.delta_lrs)]


class WarmupDecayLR(WarmupLR):
    """WarmupLR's warm-up, then linear decay to 0 at total_num_steps.

    After the warm-up the lr is min + (max - min) * gamma with gamma =
    max(0, (total_num_steps - i) / max(1, total_num_steps - warmup_num_steps)).
    Unlike WarmupLR, warmup_max_lr defaults to 0.001 (not the optimizer's lr):
    DeepSpeed's default, kept so configs mean the same.
    """

    def __init__(self, optimizer, total_num_steps, warmup_min_lr=0.0, warmup_max_lr=0.001, warmup_num_steps=1000,
                 warmup_type=_LOG, last_batch_iteration=-1):
        self.total_num_steps = _number(total_num_steps, "total_num_steps", type(self).__name__)
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type,
                         last_batch_iteration)
        if self.total_num_steps < self.warmup_num_steps:
            warnings.warn(f"WarmupDecayLR: total_num_steps {total_num_steps} is less than warmup_num_steps "
                          f"{warmup_num_steps}", stacklevel=2)

    def _gamma(self):
        if self.last_batch_iteration < self.warmup_num_steps:
            return self._warmup_gamma()
        remaining = float(self.total_num_steps - self.last_batch_iteration)
        return max(0.0, remaining / float(max(1.0, self.total_num_steps - self.warmup_num_steps)))


class WarmupCosineLR(_Schedule):
    """Each group's own lr (at construction) times a ratio: from warmup_min_ratio to 1 over
    warmup_num_steps steps (log or linear, as WarmupLR), then a cosine down to
    cos_min_ratio at total_num_steps, where it stays.

    It takes ratios, not learning rates: warmup_min_lr / warmup_max_lr are refused
    (by DeepSpeed too); the peak is the optimizer's lr (the config's optimizer.params.lr).
    """

    def __init__(self, optimizer, total_num_steps, warmup_min_ratio=0.0, warmup_num_steps=1000,
                 cos_min_ratio=0.0001, warmup_type=_LOG, last_batch_iteration=-1):
        who = type(self).__name__
        _positive_int(warmup_num_steps, "warmup_num_steps", who)
        super().__init__(optimizer, last_batch_iteration)
        self.total_num_steps = _number(total_num_steps, "total_num_steps", who)
        self.cos_min_ratio = _number(cos_min_ratio, "cos_min_ratio", who)
        self.warmup_min_ratio = _number(warmup_min_ratio, "warmup_min_ratio", who)
        self.warmup_type = _warmup_type(warmup_type, who)
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.inverse_log_warm_up = 1.0 / math.log(self.warmup_num_steps)
        if self.total_num_steps < self.warmup_num_steps:
            warnings.warn(f"WarmupCosineLR: total_num_steps {total_num_steps} is less than warmup_num_steps "
                          f"{warmup_num_steps}", stacklevel=2)
        self.org_lrs = [g["lr"].clone() if torch.is_tensor(g["lr"]) else g["lr"] for g in self.optimizer.param_groups]
        self._start()

    def get_lr_ratio(self):
        i = self.last_batch_iteration
        if i < 0:
            return 0.0
        if i < self.warmup_num_steps:
            rise = self.inverse_log_warm_up * math.log(i + 1) if self.warmup_type == _LOG \
                else i / self.warmup_num_steps
            return self.warmup_min_ratio + rise * (1.0 - self.warmup_min_ratio)
        # Progress through the cosine, held at 1 past the end (and when there is no decay window).
        progress = min(1.0, (i - self.warmup_num_steps + 1) / max(1, self.total_num_steps - self.warmup_num_steps))
        half_cosine = (1 + math.cos(math.pi * progress)) / 2
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * half_cosine)

    def get_lr(self):
        if self.last_batch_iteration < 0:
            return [0.0 for _ in self.org_lrs]
        ratio = self.get_lr_ratio()
        return [lr * ratio for lr in self.org_lrs]


class OneCycle(_Schedule):
    """The 1cycle policy: the lr rises from cycle_min_lr to cycle_max_lr over cycle_first_step_size
    batches, falls back over cycle_second_step_size (default: the first's), then, with
    decay_lr_rate and decay_step_size both nonzero, decays as cycle_min_lr / (1 + decay_lr_rate *
    j / decay_step_size) for the j-th batch after the cycle (else stays at cycle_min_lr).
    cycle_first_stair_count / cycle_second_stair_count > 0 move the lr in that many stairs per
    half cycle (the second defaults to the first).

    cycle_momentum (DeepSpeed's default True) moves each group's betas[0] the other way, from
    cycle_max_mom down to cycle_min_mom and back, with betas[1] set to 0.99; after the cycle
    betas[0] is cycle_max_mom, times (1 + decay_mom_rate * j / decay_step_size) when
    decay_mom_rate is nonzero (DeepSpeed's formula). False leaves the betas alone.
    """

    def __init__(self, optimizer, cycle_min_lr, cycle_max_lr, decay_lr_rate=0., cycle_first_step_size=2000,
                 cycle_second_step_size=None, cycle_first_stair_count=0, cycle_second_stair_count=None,
                 decay_step_size=0, cycle_momentum=True, cycle_min_mom=0.8, cycle_max_mom=0.9, decay_mom_rate=0.,
                 last_batch_iteration=-1):
        who = type(self).__name__
        super().__init__(optimizer, last_batch_iteration)
        self.cycle_momentum = bool(cycle_momentum)
        if self.cycle_momentum and "betas" not in self.optimizer.defaults:
            raise ValueError(f"{who}: cycle_momentum=True needs an optimizer with betas (Adam/AdamW); "
                             f"{type(self.optimizer).__name__} has none (set \"cycle_momentum\": false)")
        first = float(cycle_first_step_size)
        second = first if cycle_second_step_size is None else float(cycle_second_step_size)
        if first <= 0:
            raise ValueError(f"{who}: cycle_first_step_size must be positive, got {cycle_first_step_size!r}")
        if second < 0:
            raise ValueError(f"{who}: cycle_second_step_size must be >= 0, got {cycle_second_step_size!r}")
        self.first_step_size, self.second_step_size = first, second
        self.total_size = first + second
        self.step_ratio = first / self.total_size
        self.first_stair_count = cycle_first_stair_count
        self.second_stair_count = cycle_first_stair_count if cycle_second_stair_count is None \
            else cycle_second_stair_count
        self.decay_step_size = decay_step_size
        self.min_lrs = _per_group(self.optimizer, cycle_min_lr, "cycle_min_lr", who)
        self.max_lrs = _per_group(self.optimizer, cycle_max_lr, "cycle_max_lr", who)
        self.decay_lr_rate = decay_lr_rate
        # No decay after the cycle unless both the interval and the rate are nonzero.
        self.skip_lr_decay = math.isclose(decay_step_size, 0) or math.isclose(decay_lr_rate, 0)
        if self.cycle_momentum:
            self.min_moms = [(m, 0.99) for m in _per_group(self.optimizer, cycle_min_mom, "cycle_min_mom", who)]
            self.max_moms = [(m, 0.99) for m in _per_group(self.optimizer, cycle_max_mom, "cycle_max_mom", who)]
            self.decay_mom_rate = decay_mom_rate
            self.skip_mom_decay = math.isclose(decay_mom_rate, 0)
        if last_batch_iteration == -1:
            _set_lrs(self.optimizer, self.min_lrs)
            self._last_lr = list(self.min_lrs)
            if self.cycle_momentum:
                for group, betas in zip(self.optimizer.param_groups, self.min_moms):
                    group["betas"] = betas

    def _scale(self):
        """Where in the cycle batch last_batch_iteration + 1 is: 0 at cycle_min_lr, 1 at cycle_max_lr."""
        b = self.last_batch_iteration + 1
        x = 1. + b / self.total_size - math.floor(1 + b / self.total_size)
        if x <= self.step_ratio:
            scale, stairs = x / self.step_ratio, self.first_stair_count
        else:
            scale, stairs = (x - 1) / (self.step_ratio - 1), self.second_stair_count
        if stairs > 0:
            # Stairs come from the integer batch position, not from the scale
            # (whose rounding can fall just under a stair).
            in_cycle = b % self.total_size
            position = in_cycle * stairs / self.first_step_size if in_cycle <= self.first_step_size \
                else (self.total_size - in_cycle) * stairs / self.second_step_size
            scale = math.floor(position) / stairs
        return scale

    def get_lr(self):
        if self.last_batch_iteration < self.total_size:
            scale = self._scale()
            return [lo + (hi - lo) * scale for lo, hi in zip(self.min_lrs, self.max_lrs)]
        if self.skip_lr_decay:
            return list(self.min_lrs)
        decay = 1 + self.decay_lr_rate * ((self.last_batch_iteration - self.total_size + 1) / self.decay_step_size)
        return [lo / decay for lo in self.min_lrs]

    def get_mom(self):
        """The betas (one pair per param group) for batch last_batch_iteration + 1; None without cycling."""
        if not self.cycle_momentum:
            return None
        if self.last_batch_iteration < self.total_size:
            scale = self._scale()
            return [(hi[0] - (hi[0] - lo[0]) * scale, lo[1]) for lo, hi in zip(self.min_moms, self.max_moms)]
        if self.skip_mom_decay:
            return list(self.max_moms)
        factor = 1 + self.decay_mom_rate * ((self.last_batch_iteration - self.total_size + 1) / self.decay_step_size)
        return [(b0 * factor, b1) for b0, b1 in self.max_moms]

    def step(self, batch_iteration=None):  # DeepSpeed's argument name for this schedule
        super().step(batch_iteration)
        if self.cycle_momentum:
            for group, betas in zip(self.optimizer.param_groups, self.get_mom()):
                group["betas"] = betas


class LRRangeTest(_Schedule):
    """The learning-rate range test: lr_range_test_min_lr * (1 + lr_range_test_step_rate * k) with
    k = (i + 1) / lr_range_test_step_size, or its floor with lr_range_test_staircase."""

    def __init__(self, optimizer, lr_range_test_min_lr=1e-3, lr_range_test_step_size=2000,
                 lr_range_test_step_rate=1.0, lr_range_test_staircase=False, last_batch_iteration=-1):
        who = type(self).__name__
        super().__init__(optimizer, last_batch_iteration)
        self.min_lr = _per_group(self.optimizer, lr_range_test_min_lr, "lr_range_test_min_lr", who)
        self.step_size = _positive_int(lr_range_test_step_size, "lr_range_test_step_size", who)
        self.step_rate = lr_range_test_step_rate
        self.staircase = lr_range_test_staircase
        if last_batch_iteration == -1:
            self._last_lr = _set_lrs(self.optimizer, self.min_lr)

    def get_lr(self):
        k = float(self.last_batch_iteration + 1) / self.step_size
        increase = 1 + self.step_rate * (math.floor(k) if self.staircase else k)
        return [lr * increase for lr in self.min_lr]

    def step(self, batch_iteration=None):  # DeepSpeed's argument name for this schedule
        super().step(batch_iteration)


SCHEDULES = {c.__name__: c for c in (WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest)}
_REQUIRED = {"WarmupDecayLR": ("total_num_steps",), "WarmupCosineLR": ("total_num_steps",),
             "OneCycle": ("cycle_min_lr", "cycle_max_lr")}


def parameter_names(kind):
    """The "params" keys a schedule type takes (DeepSpeed's names)."""
    return [n for n in inspect.signature(SCHEDULES[kind]).parameters if n != "optimizer"]


def from_config(optimizer, section, where="scheduler"):
    """The schedule a DeepSpeed config's "scheduler" section describes, on optimizer.

    section: {"type": one of SCHEDULES, "params": {...}} ("params" may be left out: all
    defaults). Anything it does not take is a ValueError naming the key.
    """
    if not isinstance(section, dict):
        raise ValueError(f"{where}: expected an object {{\"type\": ..., \"params\": {{...}}}}, got {section!r}")
    extra = sorted(set(section) - {"type", "params"})
    if extra:
        raise ValueError(f"{where}: unknown key {extra[0]!r} (a scheduler section has \"type\" and \"params\")")
    kind = section.get("type")
    if kind not in SCHEDULES:
        raise ValueError(f"{where}.type: {kind!r} is not one of {', '.join(SCHEDULES)} (DeepSpeed's schedules; "
                         "for a torch.optim.lr_scheduler class, build it on the optimizer initialize() returns and "
                         "pass it as lr_scheduler=)")
    params = section.get("params", {})
    if not isinstance(params, dict):
        raise ValueError(f"{where}.params: expected an object, got {params!r}")
    names = parameter_names(kind)
    for key, value in params.items():
        if key not in names:
            hint = ""
            if kind == "WarmupCosineLR" and key in ("warmup_min_lr", "warmup_max_lr"):
                hint = "; WarmupCosineLR scales the optimizer's lr by ratios: use warmup_min_ratio / cos_min_ratio"
            raise ValueError(f"{where}.params.{key}: not a parameter of {kind} (it takes {', '.join(names)}){hint}")
        if value == "auto":
            raise ValueError(f"{where}.params.{key}: \"auto\" is the Hugging Face Trainer's placeholder; give a "
                             "value (strata.torch.StrataTrainer fills it from TrainingArguments)")
    missing = [k for k in _REQUIRED.get(kind, ()) if k not in params]
    if missing:
        raise ValueError(f"{where}.params.{missing[0]}: required by {kind}")
    try:
        return SCHEDULES[kind](optimizer, **params)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
