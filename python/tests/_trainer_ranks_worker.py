"""One process of test_hf_trainer_ranks.py's StrataTrainer runs:
`torchrun --nproc-per-node N _trainer_ranks_worker.py OUT NVME STAGE GAS MAX_STEPS [RESUME]`
(each process one data-parallel rank, as `torchrun train.py` runs a Trainer
script), or the same command under plain `python` (one process). Trains the
tests' small Llama with StrataTrainer on test_hf_trainer's fixed tokens in
order (sequential sampler), a micro-batch of 1 per rank, saving a Trainer
checkpoint every 2 steps; RESUME: train(resume_from_checkpoint=RESUME).
UNSEEDED_RANKS=1: ranks other than 0 start from other weights and buffers. LORA=1: a
PEFT LoRA adapter (random A and B) on q_proj and v_proj, the base frozen.
DDP_BROADCAST_BUFFERS=1: TrainingArguments(ddp_broadcast_buffers=True).
Rank 0 then writes OUT/result.json (every logged loss, learning rate and
gradient norm, the engine's world size and bytes sent, at the start of
training and in all) and OUT/state.pt
(engine.state_dict(), gathered by every rank); save_model writes OUT/model. Then evaluate on 4 held-out sequences,
one per batch (each rank its own: the sharded evaluation loop)."""
import json
import os
import sys

import torch
from transformers import TrainerCallback

from test_hf_trainer import RecordingStrataTrainer, Tokens, logged, strata_cfg, targs
from test_torch_engine import llama


def main():
    out, nvme, stage, gas, max_steps = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    resume = sys.argv[6] if len(sys.argv) > 6 else None
    torch.set_num_threads(1)
    model = llama()
    if os.environ.get("LORA") == "1":
        from peft import LoraConfig, get_peft_model
        torch.manual_seed(5)
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                 lora_dropout=0.0, init_lora_weights=False))
    rank = int(os.environ.get("RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0")))
    if os.environ.get("UNSEEDED_RANKS") == "1" and rank > 0:
        # As if each process initialised its model without a common seed:
        # the engine must train rank 0's, as DDP and DeepSpeed do.
        torch.manual_seed(rank)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
            for b in model.buffers():  # the rotary inv_freq
                if b.is_floating_point():
                    b.mul_(1.5)
    cfg = strata_cfg(nvme)
    cfg["zero_optimization"]["stage"] = stage
    if stage < 3:  # stages 1-2 keep the parameters whole on every rank: in host memory
        cfg["zero_optimization"]["offload_param"] = {"device": "cpu"}
    t = RecordingStrataTrainer(model=model, train_dataset=Tokens(16), strata_config=cfg,
                               args=targs(os.path.join(out, "run"), per_device_train_batch_size=1,
                                          gradient_accumulation_steps=gas, max_steps=max_steps,
                                          save_strategy="steps", save_steps=2, per_device_eval_batch_size=1,
                                          ddp_broadcast_buffers=os.environ.get("DDP_BROADCAST_BUFFERS") == "1" or None))
    start = {}

    class Start(TrainerCallback):  # the bytes rank 0 sent to start (the initial values' agreement)
        def on_train_begin(self, args, state, control, **kwargs):
            start["comm_bytes"] = t.strata_engine.stats()["comm_bytes"]

    t.add_callback(Start())
    t.train(resume_from_checkpoint=resume)
    eval_loss = t.evaluate(Tokens(4, seed=9))["eval_loss"]
    engine = t.strata_engine
    state = engine.state_dict()  # a collective: every rank
    t.save_model(os.path.join(out, "model"))  # every rank; rank 0 writes
    if engine.rank == 0:
        torch.save(state, os.path.join(out, "state.pt"))
        with open(os.path.join(out, "result.json"), "w") as f:
            json.dump({"world_size": engine.world_size, "comm_bytes": engine.stats()["comm_bytes"],
                   "start_comm_bytes": start["comm_bytes"],
                       "steps": engine.stats()["steps"], "loss": logged(t, "loss"),
                       "learning_rate": logged(t, "learning_rate"), "grad_norm": logged(t, "grad_norm"), "eval_loss": eval_loss}, f)
    t.destroy()


if __name__ == "__main__":
    main()
