"""strata.torch.StrataTrainer: the Hugging Face transformers.Trainer with the
model's parameters, gradients and AdamW state in Strata's engine (host RAM or
NVMe), the way Trainer(args=TrainingArguments(deepspeed=ds_config)) does it
with DeepSpeed ZeRO-3 offload:

    trainer = strata.torch.StrataTrainer(model=model, args=TrainingArguments(...),
                                         train_dataset=ds, strata_config="ds_config.json")
    trainer.train()                      # or train(resume_from_checkpoint=True)
    trainer.save_model("out")            # a from_pretrained directory with the trained fp32 weights

The Trainer keeps its loop, data, logging, callbacks and evaluation. What it
hands to Strata (the methods overridden here):
- create_optimizer: strata.torch.initialize on the model with the Trainer's
  decay / no-decay param groups and strata_config; self.optimizer is the
  engine's optimizer (its param groups carry the learning rates), the update
  is the engine's AdamW.
- create_scheduler: the config's DeepSpeed "scheduler" section
  (strata.torch.lr_schedules) if it has one, else the Trainer's own
  (lr_scheduler_type, warmup_steps / warmup_ratio: transformers.get_scheduler)
  on the engine's optimizer. The Trainer steps it after each optimizer step.
- training_step: the forward through the engine, engine.backward, and
  engine.step() (which acts at each gradient_accumulation_steps boundary).
  The Trainer's loss is already its share of the accumulated batch (its
  num_items_in_batch scaling), and the engine averages over the micro-batches,
  so the engine gets loss * gradient_accumulation_steps: the gradients are
  exactly the Trainer's.
- _clip_grad_norm / _get_grad_norm: the engine clips (config gradient_clipping)
  and reports the norm before clipping, which the Trainer logs as grad_norm.
- _save_optimizer_and_scheduler / _load_optimizer_and_scheduler: a checkpoint
  directory's strata/ subdirectory is engine.save_checkpoint (weights, AdamW
  state, step, loss scale, learning rates), scheduler.pt the scheduler's state;
  resume_from_checkpoint restores both.
- _save (save_model and checkpoints): the model's save_pretrained with the
  engine's fp32 weights (engine.state_dict()).

The config and TrainingArguments must agree, as with the Trainer's DeepSpeed
integration: a config value "auto", or a key the config leaves out, takes the
TrainingArguments value; a value that differs is refused, naming both. Keys:
train_micro_batch_size_per_gpu (per_device_train_batch_size),
gradient_accumulation_steps, train_batch_size, gradient_clipping
(max_grad_norm), optimizer.params lr / betas / eps / weight_decay
(learning_rate, adam_beta1 / adam_beta2, adam_epsilon, weight_decay; a config
without "optimizer" gets AdamW with these), bf16.enabled / fp16.enabled (bf16
/ fp16: True fills the config, which then must not say false; the config may
enable them alone), and in the "scheduler" section (only keys present)
warmup_min_lr ("auto" = 0), warmup_max_lr (learning_rate), total_num_steps
(the number of optimizer steps) and warmup_num_steps (max(1, warmup steps)).
Strata's bf16/fp16 keep bf16/fp16 compute copies with fp32 masters (what
DeepSpeed's do): the Trainer's torch autocast is turned off.

The model trains on the device TrainingArguments gives: the CPU (use_cpu=True)
or one CUDA GPU (the Trainer moves the model there; the engine then runs on
that GPU: strata.torch.initialize's GPU path, never run on a GPU yet).

Under torchrun (or accelerate launch, or mpirun) each process is one
data-parallel rank of the engine (strata.torch.initialize joins them: CPU
ranks over TCP or MPI, GPU ranks over NCCL, never run on GPUs). The engine
reduces the gradients, so _wrap_model hands the Trainer the engine's forward
and the model is never wrapped in DistributedDataParallel; the data loader's
per-rank batches, the loss scaling over processes and the logging are the
Trainer's. Every rank calls train, evaluate, save_model (a gather) and
destroy; checkpoints resume on another number of ranks.

Refused by name: TrainingArguments deepspeed, fsdp / fsdp_config, torch_compile,
several GPUs in one process (DataParallel), ddp_broadcast_buffers=True with
ranks, a device other than the CPU or one CUDA GPU,
optim other than adamw_torch / adamw_torch_fused, optim_args,
fp16_full_eval / bf16_full_eval, auto_find_batch_size, load_best_model_at_end;
Trainer's model_init, optimizers and optimizer_cls_and_kwargs; resuming from a
checkpoint without strata/ (not written by StrataTrainer). An epoch whose
micro-batch count is not a multiple of gradient_accumulation_steps ends with a
short window, stepped as the Trainer steps it (the engine's
set_gradient_accumulation_boundary).
"""
import json
import os

import torch
import transformers
from transformers.trainer import SCHEDULER_NAME

from . import lr_schedules
from .engine import _load_config, initialize

try:
    from peft import PeftModel as _PeftModel
except ImportError:  # no PEFT: no PEFT model to meet
    _PeftModel = ()

__all__ = ["StrataTrainer", "STRATA_CHECKPOINT_DIR"]

# The engine's checkpoint inside a Trainer checkpoint directory.
STRATA_CHECKPOINT_DIR = "strata"
_ADAMW = ("adamw_torch", "adamw_torch_fused")
_HIDDEN_SIZE_KEYS = ("zero_optimization.reduce_bucket_size", "zero_optimization.stage3_prefetch_bucket_size",
                     "zero_optimization.stage3_param_persistence_threshold")


def _refuse(what, why):
    raise ValueError(f"StrataTrainer: {what}: {why}")


class _Agreement:
    """Fills a config from TrainingArguments and collects where the two disagree."""

    def __init__(self, cfg):
        self.cfg, self.mismatches = cfg, []

    def node(self, path, create):
        *parents, key = path.split(".")
        node = self.cfg
        for p in parents:
            if not isinstance(node.get(p), dict):
                if not create:
                    return None, key
                node[p] = {}
            node = node[p]
        return node, key

    def fill(self, path, value, source, missing=True, match=True):
        """'auto' -> value; absent -> value when missing; another value -> a mismatch when match."""
        node, key = self.node(path, create=missing)
        if node is None:
            return
        if key not in node:
            if missing:
                node[key] = value
            return
        if node[key] == "auto":
            node[key] = value
        elif match and _plain(node[key]) != _plain(value):
            self.mismatches.append(f"{path} = {node[key]!r} in strata_config, {source} = {value!r} in "
                                   "TrainingArguments")

    def check(self):
        if self.mismatches:
            raise ValueError("StrataTrainer: strata_config and TrainingArguments disagree (make them equal, or set "
                             "the config's value to \"auto\"):\n- " + "\n- ".join(self.mismatches))


def _plain(value):
    return list(value) if isinstance(value, tuple) else value


def _find_auto(node, path=""):
    if isinstance(node, dict):
        for k, v in node.items():
            found = _find_auto(v, f"{path}.{k}" if path else k)
            if found:
                return found
    elif node == "auto":
        return path
    return None


class _EngineForward(torch.nn.Module):
    """The `model` compute_loss gets in training: calls go through the engine
    (micro-batch accounting, saved-tensor hooks); attributes are the model's,
    so a compute_loss written for the plain Trainer works unchanged."""

    def __init__(self, engine):
        super().__init__()
        self.module = engine.module
        object.__setattr__(self, "_engine", engine)  # not a submodule

    def forward(self, *args, **kwargs):
        return self._engine(*args, **kwargs)

    def _get_name(self):  # what Trainer.compute_loss's label smoothing asks the unwrapped model
        inner = self.module
        return inner.base_model.model._get_name() if isinstance(inner, _PeftModel) else inner._get_name()

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            modules = self.__dict__.get("_modules")
            if not modules or "module" not in modules:
                raise
            return getattr(modules["module"], name)


class StrataTrainer(transformers.Trainer):
    """transformers.Trainer with Strata's engine holding the training state (module docstring).

    strata_config: a DeepSpeed-style config dict or JSON path (zero_optimization
    offload_param / offload_optimizer to "cpu" or "nvme", aio, optimizer,
    gradient_clipping, bf16/fp16, scheduler, and Strata's "strata" section),
    as strata.torch.initialize takes; "auto" values are filled from
    TrainingArguments. The engine is self.strata_engine once training starts.
    """

    def __init__(self, *args, strata_config=None, **kwargs):
        targs = kwargs.get("args", args[1] if len(args) > 1 else None)
        if targs is not None:
            # Before the Trainer sets them up.
            if getattr(targs, "deepspeed", None):
                _refuse("TrainingArguments.deepspeed", "StrataTrainer takes the DeepSpeed config as strata_config= "
                        "and runs no DeepSpeed; drop deepspeed=")
            if getattr(targs, "fsdp", None):
                _refuse("TrainingArguments.fsdp", "FSDP shards the model itself; StrataTrainer offloads it to "
                        "Strata's engine instead")
        if strata_config is None:
            _refuse("strata_config", "required: a DeepSpeed-style config dict or JSON path (see docs/python.md)")
        self.strata_engine = None
        self._strata_forward = None
        super().__init__(*args, **kwargs)
        a = self.args
        for name, why in (("torch_compile", "the engine swaps parameters in and out between uses"),
                          ("fp16_full_eval", "it casts the model to fp16; set fp16.enabled in strata_config"),
                          ("bf16_full_eval", "it casts the model to bf16; set bf16.enabled in strata_config"),
                          ("auto_find_batch_size", "it changes the micro-batch size the config fixes"),
                          ("load_best_model_at_end", "not supported yet")):
            if getattr(a, name, False):
                _refuse(f"TrainingArguments.{name}", why)
        if a.n_gpu > 1:
            _refuse("TrainingArguments", f"{a.n_gpu} GPUs in one process (torch DataParallel): the engine runs on "
                    "one device per process; launch one process per GPU (torchrun --nproc-per-node N)")
        if a.world_size > 1 and a.ddp_broadcast_buffers:
            _refuse("TrainingArguments.ddp_broadcast_buffers", "there is no DistributedDataParallel to broadcast "
                    "the buffers at every forward: the engine starts every rank from rank 0's buffers once, at "
                    "initialize; leave it unset")
        if a.device.type not in ("cpu", "cuda") or (a.device.type == "cuda" and a.n_gpu != 1):
            _refuse("TrainingArguments.device", f"{a.device} ({a.n_gpu} GPUs): the engine runs on the CPU "
                    "(use_cpu=True) or on one CUDA GPU")
        if str(getattr(a.optim, "value", a.optim)) not in _ADAMW:
            _refuse("TrainingArguments.optim", f"{getattr(a.optim, 'value', a.optim)!r}: the engine runs AdamW "
                    f"({' or '.join(_ADAMW)})")
        if a.optim_args:
            _refuse("TrainingArguments.optim_args", f"{a.optim_args!r}: the optimizer's settings come from "
                    "strata_config's optimizer.params")
        if self.model_init is not None:
            _refuse("model_init", "the engine holds one model for the whole run; pass model=")
        if self.optimizer is not None or self.lr_scheduler is not None:
            _refuse("optimizers", "the optimizer is Strata's (strata_config's \"optimizer\") and the scheduler "
                    "comes from the config's \"scheduler\" or TrainingArguments; pass neither")
        if self.optimizer_cls_and_kwargs is not None:
            _refuse("optimizer_cls_and_kwargs", "the optimizer is Strata's AdamW (strata_config's \"optimizer\")")
        self.strata_config = self._agree(_load_config(strata_config))
        if a.bf16 or a.fp16:
            # Strata's bf16/fp16 (the config's) replace torch autocast, and
            # its loss scaling the GradScaler Accelerate makes for fp16 on a
            # GPU (whose step would find no scaled loss).
            self.accelerator.native_amp = False
            self.accelerator.scaler = None

    # ------------------------------------------------------------ config

    def _agree(self, cfg):
        a = self.args
        ag = _Agreement(cfg)
        gas = a.gradient_accumulation_steps
        ag.fill("train_micro_batch_size_per_gpu", a.per_device_train_batch_size, "per_device_train_batch_size")
        ag.fill("gradient_accumulation_steps", gas, "gradient_accumulation_steps")
        ag.fill("train_batch_size", a.world_size * a.per_device_train_batch_size * gas,
                "world_size * per_device_train_batch_size * gradient_accumulation_steps")
        ag.fill("gradient_clipping", float(a.max_grad_norm or 0.0), "max_grad_norm")
        if "optimizer" not in cfg:
            cfg["optimizer"] = {"type": "AdamW"}
        ag.fill("optimizer.params.lr", a.learning_rate, "learning_rate")
        ag.fill("optimizer.params.betas", [a.adam_beta1, a.adam_beta2], "[adam_beta1, adam_beta2]")
        ag.fill("optimizer.params.eps", a.adam_epsilon, "adam_epsilon")
        ag.fill("optimizer.params.weight_decay", a.weight_decay, "weight_decay")
        for key, on in (("bf16", a.bf16), ("fp16", a.fp16)):
            name = "bfloat16" if key == "bf16" and "bfloat16" in cfg else key
            # True in TrainingArguments fills and must match; False fills only "auto"
            # and leaves the config's choice.
            ag.fill(f"{name}.enabled", bool(on), key, missing=on, match=on)
        hidden = getattr(getattr(self.model, "config", None), "hidden_size", None)
        for path in _HIDDEN_SIZE_KEYS:
            node, key = ag.node(path, create=False)
            if node is not None and node.get(key) == "auto" and hidden:
                node[key] = {"reduce_bucket_size": hidden * hidden,
                             "stage3_prefetch_bucket_size": int(0.9 * hidden * hidden),
                             "stage3_param_persistence_threshold": 10 * hidden}[key]
        ag.check()
        return cfg

    def _scheduler_section(self, num_training_steps):
        section = json.loads(json.dumps(self.strata_config["scheduler"]))
        a = self.args
        ag = _Agreement(section)
        ag.fill("params.warmup_min_lr", 0, "-", missing=False, match=False)
        ag.fill("params.warmup_max_lr", a.learning_rate, "learning_rate", missing=False)
        ag.fill("params.total_num_steps", num_training_steps, "the number of optimizer steps", missing=False)
        ag.fill("params.warmup_num_steps", max(1, a.get_warmup_steps(num_training_steps)),
                "max(1, warmup steps)", missing=False)
        ag.mismatches = [f"scheduler.{m}" for m in ag.mismatches]
        ag.check()
        return section

    # ------------------------------------------------------------ optimizer and scheduler

    def create_optimizer(self, model=None):
        """The engine (strata.torch.initialize) with the Trainer's decay / no-decay param groups."""
        if self.strata_engine is None:
            m = self.model
            decay = set(self.get_decay_parameter_names(m))
            named = [(n, p) for n, p in m.named_parameters() if p.requires_grad]
            groups = [{"params": [p for n, p in named if n in decay], "weight_decay": self.args.weight_decay},
                      {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}]
            groups = [g for g in groups if g["params"]]
            cfg = {k: v for k, v in self.strata_config.items() if k != "scheduler"}
            found = _find_auto(cfg)
            if found:
                _refuse(f"strata_config {found}", "\"auto\", and TrainingArguments has no value for it")
            self.strata_engine, _, _, _ = initialize(model=m, model_parameters=groups, config=cfg)
            self._strata_forward = _EngineForward(self.strata_engine)
        if self.optimizer is None:
            self.optimizer = self.strata_engine.optimizer
            self.optimizer._quiet_state_dict = True  # accelerate's prepare() round-trips it; the engine saves it
        return self.optimizer

    def create_scheduler(self, num_training_steps, optimizer=None):
        """The config's DeepSpeed "scheduler" section, else the Trainer's, on the engine's optimizer."""
        if self.lr_scheduler is None:
            if self.strata_engine is None:
                self.create_optimizer()
            if "scheduler" in self.strata_config:
                self.lr_scheduler = lr_schedules.from_config(self.strata_engine.optimizer,
                                                             self._scheduler_section(num_training_steps),
                                                             where="strata_config scheduler")
                self._created_lr_scheduler = True
            else:
                super().create_scheduler(num_training_steps, optimizer=self.strata_engine.optimizer)
        return self.lr_scheduler

    # ------------------------------------------------------------ training

    def training_step(self, model, inputs, num_items_in_batch=None):
        """One micro-batch: forward through the engine, engine.backward, engine.step() (acts at the boundary)."""
        engine = self.strata_engine
        gas = engine.gradient_accumulation_steps
        k = self.current_gradient_accumulation_steps  # this window's micro-batches (< gas: an epoch's last)
        # The Trainer says where the window ends (a short last window of an epoch too).
        engine.set_gradient_accumulation_boundary(bool(self.accelerator.sync_gradients))
        engine.module.train()
        inputs = self._prepare_inputs(inputs)
        with self.compute_loss_context_manager():
            loss = self.compute_loss(self._strata_forward, inputs, num_items_in_batch=num_items_in_batch)
        del inputs
        if self.loss_is_scaled_for_ga is not None:
            scaled = self.loss_is_scaled_for_ga
        else:
            scaled = (self.model_accepts_loss_kwargs and num_items_in_batch is not None) \
                or self.compute_loss_func is not None
        # engine.backward divides by gas (DeepSpeed's convention) and the step
        # sums the window: a loss the Trainer already normalized over the
        # window goes in times gas; a micro-batch's mean loss times gas / k,
        # so the window's gradient is the mean over its k micro-batches.
        engine.backward(loss * gas if scaled else loss * (gas / k))
        result = engine.step()
        if (result is not None) != bool(self.accelerator.sync_gradients):
            raise RuntimeError(f"StrataTrainer: the engine {'stepped' if result else 'did not step'} after this "
                               "micro-batch and the Trainer's accumulation boundary says the opposite")
        if result is not None:
            # A step the engine skipped (non-finite gradients, fp16 overflow):
            # the Trainer then leaves the scheduler alone, as after a skipped
            # GradScaler step (Accelerator.optimizer_step_was_skipped).
            for opt in getattr(self.accelerator, "_optimizers", []):
                if hasattr(opt, "_is_overflow"):
                    opt._is_overflow = bool(result["skipped"])
        return (loss if scaled else loss / k).detach()

    def _wrap_model(self, model, training=True, dataloader=None):
        # Once the engine holds the model, training and evaluation go through
        # it (a forward under no_grad is no micro-batch), and it reduces the
        # gradients over the ranks itself: never DistributedDataParallel,
        # which Accelerate would wrap the model in under torchrun (its
        # all-reduce would run next to the engine's, and its start broadcasts
        # parameters the engine holds), nor Accelerate's device placement
        # (model.to, on parameters whose values live in the engine).
        # Returning a model other than self.model keeps the Trainer from
        # passing it to accelerator.prepare.
        if self._strata_forward is not None:
            return self._strata_forward
        return super()._wrap_model(model, training=training, dataloader=dataloader)

    def _clip_grad_norm(self, model):
        return self._get_grad_norm(model)

    def _get_grad_norm(self, model, grad_norm=None):
        """The engine's global gradient norm of the last step, before clipping."""
        last = getattr(self.strata_engine, "last_step", None)
        return None if last is None else float(last["grad_norm"])

    # ------------------------------------------------------------ saving and resuming

    def _save(self, output_dir=None, state_dict=None):
        if state_dict is None and self.strata_engine is not None:
            # A gather on every rank; only the writers keep the weights.
            state_dict = self.strata_engine._state_dict(self.args.should_save)
        super()._save(output_dir, state_dict=state_dict)

    def _save_optimizer_and_scheduler(self, output_dir):
        self.strata_engine.save_checkpoint(os.path.join(output_dir, STRATA_CHECKPOINT_DIR))
        if self.args.should_save and self.lr_scheduler is not None:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _strata_checkpoint(self, checkpoint):
        d = os.path.join(checkpoint, STRATA_CHECKPOINT_DIR)
        if not os.path.isdir(d):
            _refuse(f"resume_from_checkpoint {checkpoint}", f"has no {STRATA_CHECKPOINT_DIR}/ (the engine's "
                    "checkpoint): it was not written by StrataTrainer (to start from its weights, load the model "
                    "with from_pretrained and train without resume_from_checkpoint)")
        return d

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        # The weights come back with the engine's checkpoint
        # (_load_optimizer_and_scheduler); only check it is there.
        self._strata_checkpoint(resume_from_checkpoint)

    def _load_optimizer_and_scheduler(self, checkpoint):
        if checkpoint is None:
            return
        d = self._strata_checkpoint(checkpoint)
        loaded, _ = self.strata_engine.load_checkpoint(d)
        if loaded is None:
            _refuse(f"resume_from_checkpoint {checkpoint}", f"{d} holds no engine checkpoint (no \"latest\" file)")
        path = os.path.join(checkpoint, SCHEDULER_NAME)
        if self.lr_scheduler is not None and os.path.isfile(path):
            self.lr_scheduler.load_state_dict(torch.load(path, weights_only=True))

    def _load_scaler(self, checkpoint):
        return None  # the fp16 loss scale is in the engine's checkpoint

    # ------------------------------------------------------------ end

    def destroy(self):
        """Frees the engine (its files and memory) now rather than at garbage collection."""
        if self.strata_engine is not None:
            self.strata_engine.destroy()
