"""strata.torch.StrataTrainer against the plain transformers.Trainer.

A tiny Llama (test_torch_engine's) trained by StrataTrainer with parameters
and optimizer state on NVMe (a temporary directory) and by transformers.Trainer
with optim="adamw_torch", on the same fixed dataset in the same order
(train_sampling_strategy="sequential", no dropout): gradient accumulation 2,
weight decay 0.01 on the Trainer's decay group, max_grad_norm 1.0, linear
schedule with warm-up. Compared: every micro-batch's loss (relative 1e-5),
the logged learning rates (equal) and gradient norms (relative 1e-5), the
final weights (|strata - torch| / |torch update| over all weights <= 1e-4,
test_torch_engine's fp32 tolerances), the evaluation loss, and save_model's
directory loaded with from_pretrained. Also: the config's DeepSpeed scheduler
with "auto" values, PEFT LoRA, resume_from_checkpoint equal to an
uninterrupted run (bit for bit), refusals.
"""
import copy
import os
import shutil
import tempfile
import unittest

import torch
from transformers import LlamaForCausalLM, Trainer, TrainingArguments
from transformers.trainer_callback import PrinterCallback

import strata.torch as st
from test_torch_engine import LOSS_TOL, VOCAB, WEIGHT_TOL, llama

StrataTrainer = st.StrataTrainer


class Tokens(torch.utils.data.Dataset):
    """n fixed random sequences; the model's loss shifts the labels itself."""

    def __init__(self, n, T=32, seed=1):
        g = torch.Generator().manual_seed(seed)
        self.x = [torch.randint(0, VOCAB, (T,), generator=g) for _ in range(n)]

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.x[i]}


class _Record:
    """Keeps every micro-batch's loss (what training_step returns); prints no logs."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.losses = []
        self.remove_callback(PrinterCallback)

    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)
        self.losses.append(loss.item())
        return loss


class PlainTrainer(_Record, Trainer):
    pass


class RecordingStrataTrainer(_Record, StrataTrainer):
    pass


def targs(out, **kw):
    a = dict(output_dir=out, per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=5,
             learning_rate=2e-3, lr_scheduler_type="linear", warmup_steps=2, weight_decay=0.01, max_grad_norm=1.0,
             optim="adamw_torch", logging_steps=1, save_strategy="no", report_to="none", use_cpu=True,
             train_sampling_strategy="sequential", seed=0, disable_tqdm=True, dataloader_num_workers=0)
    a.update(kw)
    return TrainingArguments(**a)


def strata_cfg(nvme, extra=None):
    c = {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": nvme},
                               "offload_optimizer": {"device": "nvme", "nvme_path": nvme}}}
    c.update(extra or {})
    return c


def logged(trainer, key):
    return [e[key] for e in trainer.state.log_history if key in e and "train_runtime" not in e]


class StrataTrainerTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="strata-hf-trainer-test-", dir=os.environ.get("STRATA_TEST_DIR"))

    def tearDown(self):
        shutil.rmtree(self.dir, ignore_errors=True)

    def path(self, name):
        d = os.path.join(self.dir, name)
        os.makedirs(d, exist_ok=True)
        return d

    def plain(self, model, data, **kw):
        t = PlainTrainer(model=model, args=targs(self.path("plain"), **kw), train_dataset=data)
        t.train()
        return t

    def strata(self, model, data, nvme="nvme", extra=None, out="strata", **kw):
        t = RecordingStrataTrainer(model=model, args=targs(self.path(out), **kw), train_dataset=data,
                                   strata_config=strata_cfg(self.path(nvme), extra))
        return t

    def compare(self, what, ref, init, sd, tp, ts):
        self.assertEqual(len(ts.losses), len(tp.losses))
        loss_err = max(abs(a - b) / abs(b) for a, b in zip(ts.losses, tp.losses))
        self.assertLessEqual(loss_err, LOSS_TOL, f"{what}: losses {ts.losses} vs {tp.losses}")
        self.assertEqual(logged(ts, "learning_rate"), logged(tp, "learning_rate"), what)
        norm_err = max(abs(a - b) / b for a, b in zip(logged(ts, "grad_norm"), logged(tp, "grad_norm")))
        self.assertLessEqual(norm_err, LOSS_TOL, what)
        num = den = 0.0
        for k, w in ref.state_dict().items():
            num += (sd[k].double() - w.double()).norm().item() ** 2
            den += (w.double() - init[k].double()).norm().item() ** 2
        ratio = num ** 0.5 / den ** 0.5
        print(f"  {what}: {len(ts.losses)} micro-batches, losses within {loss_err:.1e}, grad norms within "
              f"{norm_err:.1e}, weights |diff| / |update| = {ratio:.2e}")
        self.assertLessEqual(ratio, WEIGHT_TOL, what)

    def test_matches_trainer_with_adamw_torch(self):
        data, held_out = Tokens(20), Tokens(4, seed=9)
        ref = llama()
        init = copy.deepcopy(ref.state_dict())
        tp = self.plain(ref, data)
        ts = self.strata(llama(), data)
        ts.train()
        engine = ts.strata_engine
        self.assertGreater(engine.stats()["tier_bytes"]["nvme"], 0)
        self.assertEqual(engine.stats()["steps"], 5)
        self.assertEqual(ts.strata_config["gradient_accumulation_steps"], 2)
        self.assertEqual(ts.strata_config["optimizer"]["params"]["weight_decay"], 0.01)
        sd = engine.state_dict()
        self.compare("Trainer, llama on NVMe, accumulation 2, decay groups, clipping, linear warm-up", ref, init, sd,
                     tp, ts)
        ep, es = tp.evaluate(held_out)["eval_loss"], ts.evaluate(held_out)["eval_loss"]
        self.assertLessEqual(abs(ep - es) / ep, LOSS_TOL, f"eval_loss {es} vs {ep}")
        out = self.path("saved")
        ts.save_model(out)
        back = LlamaForCausalLM.from_pretrained(out)
        for k, v in back.state_dict().items():
            self.assertTrue(torch.equal(v, sd[k]), f"save_model: {k}")
        ts.destroy()

    def test_epochs_with_a_short_last_window(self):
        # 5 micro-batches per epoch, accumulation 2, two epochs: each epoch
        # ends with a window of one micro-batch, stepped as the Trainer steps.
        data = Tokens(10)
        ref = llama()
        init = copy.deepcopy(ref.state_dict())
        tp = self.plain(ref, data, max_steps=-1, num_train_epochs=2)
        ts = self.strata(llama(), data, max_steps=-1, num_train_epochs=2)
        ts.train()
        self.assertEqual(ts.strata_engine.stats()["steps"], 6)
        self.compare("Trainer, 2 epochs of 5 micro-batches, accumulation 2", ref, init, ts.strata_engine.state_dict(),
                     tp, ts)
        ts.destroy()

    def test_activation_checkpointing(self):
        # TrainingArguments(activation_checkpointing=True): the Trainer turns
        # on the model's (non-reentrant) checkpointing; the same on both.
        data = Tokens(12)
        ref = llama()
        init = copy.deepcopy(ref.state_dict())
        tp = self.plain(ref, data, max_steps=3, activation_checkpointing=True)
        ts = self.strata(llama(), data, max_steps=3, activation_checkpointing=True)
        ts.train()
        self.assertTrue(ts.model.is_activation_checkpointing)
        self.compare("Trainer, activation checkpointing", ref, init, ts.strata_engine.state_dict(), tp, ts)
        ts.destroy()

    def test_config_scheduler_with_auto_values(self):
        # The config's WarmupDecayLR with "auto" values filled from TrainingArguments, against
        # the plain Trainer driven by the same schedule (strata.torch.lr_schedules, which
        # test_lr_schedules holds equal to DeepSpeed's; DeepSpeed's warm-up starts one step
        # later than the Trainer's "linear").
        class PlainWarmupDecay(PlainTrainer):
            def create_scheduler(self, num_training_steps, optimizer=None):
                if self.lr_scheduler is None:
                    self.lr_scheduler = st.lr_schedules.WarmupDecayLR(
                        optimizer or self.optimizer, total_num_steps=num_training_steps,
                        warmup_max_lr=self.args.learning_rate, warmup_num_steps=2, warmup_type="linear")
                return self.lr_scheduler
        data = Tokens(20)
        ref = llama()
        init = copy.deepcopy(ref.state_dict())
        tp = PlainWarmupDecay(model=ref, args=targs(self.path("plain")), train_dataset=data)
        tp.train()
        sched = {"scheduler": {"type": "WarmupDecayLR", "params": {
            "warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto", "total_num_steps": "auto",
            "warmup_type": "linear"}}}
        extra = {**sched, "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
                 "train_micro_batch_size_per_gpu": "auto",
                 "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                           "weight_decay": "auto"}}}
        ts = self.strata(llama(), data, extra=extra)
        ts.train()
        self.assertIsInstance(ts.lr_scheduler, st.lr_schedules.WarmupDecayLR)
        self.assertEqual((ts.lr_scheduler.total_num_steps, ts.lr_scheduler.warmup_num_steps), (5, 2))
        self.compare("Trainer, WarmupDecayLR from strata_config with \"auto\" values", ref, init,
                     ts.strata_engine.state_dict(), tp, ts)
        ts.destroy()

    def test_peft_lora(self):
        from peft import LoraConfig, get_peft_model
        data = Tokens(12)
        lcfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                          init_lora_weights=False)
        torch.manual_seed(5)
        ref = get_peft_model(llama(), lcfg)
        m = copy.deepcopy(ref)
        init = copy.deepcopy(ref.state_dict())
        tp = self.plain(ref, data, max_steps=3)
        ts = self.strata(m, data, max_steps=3)
        ts.train()
        sd = ts.strata_engine.state_dict()
        self.compare("Trainer, PEFT LoRA (frozen base on NVMe)", ref, init, sd, tp, ts)
        out = self.path("adapter")
        ts.save_model(out)
        self.assertTrue(os.path.isfile(os.path.join(out, "adapter_model.safetensors")))
        ts.destroy()

    def test_resume_from_checkpoint_equals_uninterrupted(self):
        data = Tokens(24)
        kw = dict(max_steps=6, save_strategy="steps", save_steps=3)
        straight = self.strata(llama(), data, nvme="a", out="straight", **kw)
        straight.train()
        final = straight.strata_engine.state_dict()
        ck = os.path.join(self.dir, "straight", "checkpoint-3")
        self.assertTrue(os.path.isdir(os.path.join(ck, st.hf_trainer.STRATA_CHECKPOINT_DIR)))
        straight.destroy()
        resumed = self.strata(llama(), data, nvme="b", out="resumed", **kw)
        resumed.train(resume_from_checkpoint=ck)
        self.assertEqual(resumed.losses, straight.losses[6:])
        # (the resumed log has steps 1-3 from the checkpoint's trainer state)
        self.assertEqual(logged(resumed, "learning_rate"), logged(straight, "learning_rate"))
        for k, v in resumed.strata_engine.state_dict().items():
            self.assertTrue(torch.equal(v, final[k]), k)
        resumed.destroy()

    def test_bf16_from_training_arguments(self):
        # bf16=True fills the config's bf16.enabled: bf16 compute copies with fp32 masters
        # (DeepSpeed's bf16), and no torch autocast around the model.
        data = Tokens(8)
        tf = self.strata(llama(), data, nvme="fp32", out="fp32", max_steps=2)
        tf.train()
        m = llama()
        tb = self.strata(m, data, nvme="bf16", out="bf16", max_steps=2, bf16=True)
        self.assertEqual(tb.strata_config["bf16"], {"enabled": True})
        tb.train()
        self.assertEqual(next(m.parameters()).dtype, torch.bfloat16)
        self.assertFalse(tb.accelerator.native_amp)
        print(f"  Trainer bf16=True: losses {[round(x, 4) for x in tb.losses]} (fp32: "
              f"{[round(x, 4) for x in tf.losses]})")
        for a, b in zip(tb.losses, tf.losses):
            self.assertLess(abs(a - b) / b, 1e-2)
        tf.destroy()
        tb.destroy()

    def test_a_skipped_step_leaves_the_schedule(self):
        # fp16 (the config's) with a loss scale of 2^32: the engine skips the first steps for
        # overflow, and the Trainer's linear warm-up stays at its first lr, as after a skipped
        # GradScaler step.
        ts = self.strata(llama(), Tokens(8), max_steps=2,
                         extra={"fp16": {"enabled": True, "initial_scale_power": 32}})
        ts.train()
        self.assertTrue(ts.strata_engine.last_step["skipped"])
        self.assertEqual(ts.strata_engine.stats()["steps"], 0)
        self.assertEqual(logged(ts, "learning_rate"), [0.0, 0.0])
        ts.destroy()

    def refuse(self, pattern, model=None, data=None, extra=None, train=False, ctor=None, **kw):
        with self.assertRaisesRegex(ValueError, pattern):
            t = (ctor or StrataTrainer)(model=model or llama(), args=targs(self.path("r"), **kw),
                                        train_dataset=data or Tokens(8), strata_config=strata_cfg(self.path("rn"),
                                                                                                  extra))
            if train:
                t.train(**({} if train is True else train))

    def test_refusals(self):
        self.refuse(r"TrainingArguments.deepspeed: StrataTrainer takes the DeepSpeed config as strata_config=",
                    deepspeed={"zero_optimization": {"stage": 3}})
        self.refuse(r"TrainingArguments.optim: 'sgd'", optim="sgd")
        self.refuse(r"bf16.enabled = False in strata_config, bf16 = True", bf16=True,
                    extra={"bf16": {"enabled": False}})
        self.refuse(r"TrainingArguments.torch_compile", torch_compile=True)
        self.refuse(r"gradient_accumulation_steps = 4 in strata_config, gradient_accumulation_steps = 2 in "
                    r"TrainingArguments", extra={"gradient_accumulation_steps": 4})
        self.refuse(r"gradient_clipping = 0.5 in strata_config, max_grad_norm = 1.0",
                    extra={"gradient_clipping": 0.5})
        self.refuse(r"optimizer.params.lr = 0.001 in strata_config, learning_rate = 0.002",
                    extra={"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})
        self.refuse(r"scheduler.params.warmup_num_steps = 100 in strata_config",
                    extra={"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 100}}}, train=True)
        self.refuse(r"StrataTrainer: optimizers:", ctor=lambda **k: StrataTrainer(
            optimizers=(torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=1), None), **k))
        self.refuse(r"StrataTrainer: model_init:",
                    ctor=lambda model, **k: StrataTrainer(model_init=lambda: llama(), **k))
        with self.assertRaisesRegex(ValueError, r"strata_config: required"):
            StrataTrainer(model=llama(), args=targs(self.path("r")), train_dataset=Tokens(8))
        # A checkpoint the plain Trainer wrote has no engine checkpoint to resume from.
        tp = self.plain(llama(), Tokens(8), max_steps=2, save_strategy="steps", save_steps=2)
        ck = os.path.join(tp.args.output_dir, "checkpoint-2")
        self.assertTrue(os.path.isdir(ck))
        self.refuse(r"checkpoint-2: has no strata/ .*not written by StrataTrainer",
                    train={"resume_from_checkpoint": ck})


if __name__ == "__main__":
    unittest.main()
