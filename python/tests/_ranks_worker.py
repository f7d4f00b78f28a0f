"""One rank of test_torch_ranks.py, run as `mpirun -np N python _ranks_worker.py
OUT STAGE NVME` or `torchrun --nproc-per-node N _ranks_worker.py OUT STAGE NVME
[pg]` (pg: torch.distributed.init_process_group("gloo") first, as trainers
do), or all ranks at once as `python _ranks_worker.py OUT STAGE NVME spawn
tcp|env|env-ws PORT`: torch.multiprocessing.spawn starts 2 processes without
RANK or WORLD_SIZE in their environment, each making its process group with
init_process_group("gloo", rank=, world_size=) and init_method
tcp://127.0.0.1:PORT (tcp) or MASTER_ADDR=localhost, MASTER_PORT=PORT (env,
PyTorch's DDP tutorial), or with WORLD_SIZE=2 exported too, no RANK, and
init_process_group("gloo", rank=) (env-ws); the engine then takes its ranks
from that group.
Each rank trains the tests' small Llama through strata.torch.initialize (the
engine joins the ranks) on its rows of each batch (rank r takes row r), then
writes OUT/losses<rank>.json, and (rank 0) OUT/state.pt from
engine.state_dict() and OUT/model from save_pretrained; state_dict(rank=0) must
give rank 0 the same tensors and the other ranks none. A save whose `latest`
rank 0 cannot write raises on every rank (OUT/losses<rank>.json says what)."""
import json
import os
import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import strata.torch as st
from strata import StrataError

VOCAB = 96


def train(out, stage, nvme):
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, initializer_range=0.1))
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
           "optimizer": {"type": "AdamW", "params": {"lr": 2e-3, "weight_decay": 0.01}},
           "zero_optimization": {"stage": stage, "offload_param": {"device": "cpu"},
                                 "offload_optimizer": {"device": "nvme", "nvme_path": nvme}}}
    engine, _, _, _ = st.initialize(model=model, config=cfg)
    g = torch.Generator().manual_seed(1)
    data = [torch.randint(0, VOCAB, (engine.world_size, 33), generator=g) for _ in range(4)]
    losses = []
    for x in data:
        mine = x[engine.rank:engine.rank + 1]
        logits = engine(input_ids=mine[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), mine[:, 1:].reshape(-1))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    # A checkpoint whose `latest` rank 0 cannot write (a directory is in the
    # way): every rank raises, not rank 0 alone.
    ck = os.path.join(out, "ck")
    if engine.rank == 0:
        os.makedirs(os.path.join(ck, "latest", "in-the-way"))
    try:
        engine.save_checkpoint(ck, tag="t1")
        latest_error = None
    except StrataError as e:
        latest_error = str(e)
    with open(os.path.join(out, f"losses{engine.rank}.json"), "w") as f:
        json.dump({"rank": engine.rank, "world_size": engine.world_size, "losses": losses,
                   "comm_bytes": engine.stats()["comm_bytes"], "latest_error": latest_error}, f)
    state = engine.state_dict()  # a collective: every rank
    only0 = engine.state_dict(rank=0)  # the same gather, kept on rank 0 only
    if engine.rank == 0:
        assert sorted(only0) == sorted(state) and all(torch.equal(only0[k], state[k]) for k in state), "rank=0"
    else:
        assert len(only0) == 0, f"state_dict(rank=0) gave rank {engine.rank} {len(only0)} tensors"
    engine.save_pretrained(os.path.join(out, "model"))  # every rank; rank 0 writes
    if engine.rank == 0:
        torch.save(state, os.path.join(out, "state.pt"))
    engine.destroy()


def spawned(rank, how, port, out, stage, nvme):
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(key, None)
    if how == "tcp":
        torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    elif how == "env-ws":  # the parent exported WORLD_SIZE too (not RANK), as many scripts do
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"], os.environ["WORLD_SIZE"] = "localhost", str(port), "2"
        torch.distributed.init_process_group("gloo", rank=rank)
    else:
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "localhost", str(port)
        torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
    train(out, stage, nvme)
    torch.distributed.destroy_process_group()


def main():
    out, stage, nvme = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    if sys.argv[4:5] == ["spawn"]:
        how, port = sys.argv[5], int(sys.argv[6])
        torch.multiprocessing.spawn(spawned, args=(how, port, out, stage, nvme), nprocs=2)
        return
    pg = sys.argv[4:] == ["pg"]
    if pg:
        torch.distributed.init_process_group("gloo")
    train(out, stage, nvme)
    if pg:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
