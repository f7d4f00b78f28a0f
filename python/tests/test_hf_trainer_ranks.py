"""StrataTrainer with data-parallel ranks (issue 14): a Trainer script launched
by `torchrun --nproc-per-node 2` (or `mpirun -np 2`) trains as 2 ranks of one
engine, each process one rank, as the same script under DeepSpeed would.

_trainer_ranks_worker.py trains the tests' small Llama on fixed tokens in
order (sequential sampler), a micro-batch of 1 per rank, clipping on
(max_grad_norm 1.0), linear warm-up, parameters (stage 3) and optimizer on
NVMe, checkpoints every 2 of 4 steps, then evaluates on 4 held-out sequences
and saves the model. 2 ranks without accumulation against one process with
gradient_accumulation_steps 2: the Trainer's data loader gives rank r the
sequences 2s + r at step s, the one process the same two as its 2
micro-batches, so the runs see the same data, and they agree bit for bit:
every logged loss and learning rate, the evaluation loss, the final weights
and the saved model. Why exact: the Trainer scales each rank's loss by the
number of processes (its DDP convention) and the engine's rank-order mean
divides by it again, powers of two both. The logged gradient norms agree to
1e-12 (the engine sums squares per rank's shard, then over ranks, in a
different order from one rank). Checkpoints move between rank counts: the 2
ranks' step-2 checkpoint resumed by one process, and the one process's by 2
ranks, end equal to the uninterrupted run, bit for bit. A PEFT LoRA model
(frozen base, random adapters) trains the same way on 2 ranks and one
process, bit for bit, adapters saved alike. With accumulation (2 ranks of 2
micro-batches, one process of 4) the runs agree to rounding. In the 2-rank runs of
test_two_ranks_equal_one_process and test_lora_ranks_equal_one_process, rank
1 builds its model with other weights (an unseeded init): the engine
starts every rank from rank 0's (strata_engine_broadcast at initialize), as
DDP and DeepSpeed do, so the runs still agree.

Needs torchrun (torch) and mpirun: mpirun's case is skipped without it, a
failure instead under STRATA_REQUIRE_REFERENCE=1 (CI).
"""
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import unittest

import safetensors.torch
import torch

from test_torch_ranks import mpirun

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "_trainer_ranks_worker.py")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def saved_model(out):
    """save_model's tensors: the model's, or a PEFT model's adapter."""
    d = os.path.join(out, "model")
    name = "adapter_model.safetensors" if os.path.isfile(os.path.join(d, "adapter_model.safetensors")) \
        else "model.safetensors"
    return safetensors.torch.load_file(os.path.join(d, name))


class TrainerRanksTest(unittest.TestCase):
    reference = None  # the one-process run's (result, state, its directory)

    @classmethod
    def setUpClass(cls):
        cls.dir = tempfile.mkdtemp(prefix="strata-trainer-ranks-", dir=os.environ.get("STRATA_TEST_DIR"))
        cls.env = dict(os.environ, OMP_NUM_THREADS="1", TMPDIR=cls.dir)  # torchrun's torchelastic_* dirs go there
        for key in ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                    "MASTER_ADDR", "MASTER_PORT"):
            cls.env.pop(key, None)

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.dir, ignore_errors=True)

    def run_job(self, name, launcher, stage, gas, resume=None, unseeded=False, lora=False):
        """The worker under `launcher` ("one", "torchrun" or "mpirun"): (result, state, its directory).
        unseeded: rank 1 starts from other weights than rank 0; lora: a PEFT LoRA model."""
        out = os.path.join(self.dir, name)
        nvme = out + "-nvme"
        os.makedirs(out)
        os.makedirs(nvme)
        args = [WORKER, out, nvme, str(stage), str(gas), "4"] + ([resume] if resume else [])
        env = dict(self.env, UNSEEDED_RANKS="1" if unseeded else "0", LORA="1" if lora else "0")
        if launcher == "one":
            cmd = [sys.executable]
        elif launcher == "torchrun":
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
                   "127.0.0.1", "--master-port", str(free_port())]
        else:
            # Accelerate makes the Trainer's gloo group from MASTER_ADDR and
            # MASTER_PORT under mpirun; the engine's ranks are MPI's.
            env = dict(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
                       OMPI_MCA_btl_vader_single_copy_mechanism="none", OMPI_MCA_rmaps_base_oversubscribe="1")
            cmd = [launcher, "--oversubscribe", "--allow-run-as-root", "-np", "2", sys.executable]
        r = subprocess.run(cmd + args, env=env, cwd=HERE, capture_output=True, text=True, timeout=600)
        self.assertEqual(r.returncode, 0, f"{name}: the job failed:\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}")
        with open(os.path.join(out, "result.json")) as f:
            result = json.load(f)
        self.assertEqual(result["world_size"], 1 if launcher == "one" else 2, name)
        self.assertEqual(result["steps"], 4, name)
        return result, torch.load(os.path.join(out, "state.pt")), out

    def one_process(self):
        if TrainerRanksTest.reference is None:
            TrainerRanksTest.reference = self.run_job("one", "one", 3, 2)
        return TrainerRanksTest.reference

    def assert_equal_runs(self, what, got, ref):
        (res, state, out), (ref_res, ref_state, ref_out) = got, ref
        for key in ("loss", "learning_rate", "eval_loss"):
            self.assertEqual(res[key], ref_res[key], f"{what}: {key}")
        self.assertEqual(len(res["grad_norm"]), len(ref_res["grad_norm"]), what)
        for a, b in zip(res["grad_norm"], ref_res["grad_norm"]):
            self.assertLessEqual(abs(a - b), 1e-12 * b, f"{what}: grad_norm {res['grad_norm']} vs {ref_res['grad_norm']}")
        self.assertEqual(sorted(state), sorted(ref_state), what)
        for key in ref_state:
            self.assertTrue(torch.equal(state[key], ref_state[key]), f"{what}: {key} differs")
        saved, ref_saved = saved_model(out), saved_model(ref_out)
        self.assertEqual(sorted(saved), sorted(ref_saved), what)
        for key, v in saved.items():
            self.assertTrue(torch.equal(v, ref_saved[key]), f"{what}: save_model's {key}")

    def test_two_ranks_equal_one_process(self):
        ref = self.one_process()
        jobs = [("torchrun, stage 3", "torchrun", 3), ("torchrun, stage 2", "torchrun", 2)]
        exe = mpirun()
        if exe is not None:
            jobs.append(("mpirun, stage 3", exe, 3))
        for what, launcher, stage in jobs:
            got = self.run_job(what.replace(", ", "-").replace(" ", ""), launcher, stage, 1, unseeded=True)
            self.assertGreater(got[0]["comm_bytes"], 0, what)
            # Every parameter differs on rank 1: rank 0 sent the whole fp32 model to start.
            self.assertGreaterEqual(got[0]["start_comm_bytes"], 4 * sum(v.numel() for v in ref[1].values()), what)
            self.assert_equal_runs(what, got, ref)
            print(f"  {what}: 2 ranks x 4 steps equal one process of 2 micro-batches bit for bit (losses "
                  f"{[round(x, 4) for x in ref[0]['loss']]}, eval_loss {ref[0]['eval_loss']:.4f}); sent per rank: "
                  f"{got[0]['comm_bytes']} bytes")
        if exe is None:
            self.skipTest("mpirun is not installed (the torchrun cases ran)")

    def test_accumulation_on_ranks(self):
        # 2 ranks accumulating 2 micro-batches against one process of 4: the
        # same sequences per step (rank r's micro-batch m of step s is
        # sequence 4s + 2m + r), summed in another order, so equal to
        # rounding (fp32 gradients of 4 summed in another grouping): losses
        # and learning rates exactly, gradient norms to 1e-6 (the scale a
        # wrong loss normalisation would change by x2 while Adam's update
        # hides it), weights to 1e-6.
        ref = self.run_job("accum-one", "one", 3, 4)
        got = self.run_job("accum-torchrun", "torchrun", 3, 2)
        (res, state, _), (ref_res, ref_state, _) = got, ref
        self.assertEqual(res["loss"], ref_res["loss"])
        self.assertEqual(res["learning_rate"], ref_res["learning_rate"])
        for a, b in zip(res["grad_norm"], ref_res["grad_norm"]):
            self.assertLessEqual(abs(a - b), 1e-6 * b, f"grad_norm {res['grad_norm']} vs {ref_res['grad_norm']}")
        diff = max((state[k] - ref_state[k]).abs().max().item() for k in ref_state)
        self.assertLessEqual(diff, 1e-6)
        print(f"  torchrun, 2 ranks x 2 micro-batches against one process of 4: losses equal, weights within "
              f"{diff:.1e}")

    def test_lora_ranks_equal_one_process(self):
        # PEFT LoRA: frozen base weights (stage 3, sharded on NVMe), random
        # adapters; rank 1 starts from other values of both.
        ref = self.run_job("lora-one", "one", 3, 2, lora=True)
        got = self.run_job("lora-torchrun", "torchrun", 3, 1, unseeded=True, lora=True)
        self.assert_equal_runs("PEFT LoRA, torchrun, stage 3", got, ref)
        self.assertTrue(any("lora_A" in k for k in got[1]), sorted(got[1])[:4])
        print(f"  PEFT LoRA, torchrun, stage 3: 2 ranks equal one process bit for bit (losses "
              f"{[round(x, 4) for x in ref[0]['loss']]}), the adapter save_model writes too")

    def test_ddp_broadcast_buffers_is_refused_by_name(self):
        out = os.path.join(self.dir, "ddp-buffers")
        os.makedirs(out)
        r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
                            "127.0.0.1", "--master-port", str(free_port()), WORKER, out, out + "-nvme", "3", "1", "4"],
                           env=dict(self.env, DDP_BROADCAST_BUFFERS="1"), cwd=HERE, capture_output=True, text=True,
                           timeout=600)
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("TrainingArguments.ddp_broadcast_buffers: there is no DistributedDataParallel", r.stderr)

    def test_checkpoints_move_between_rank_counts(self):
        ref = self.one_process()
        ranks = self.run_job("ranks", "torchrun", 3, 1)
        # The same weights on both ranks: only checksums went out to start,
        # not the model (rank 0's bytes; 16 per parameter and 1 per verdict).
        self.assertLess(ranks[0]["start_comm_bytes"], 1000, ranks[0]["start_comm_bytes"])
        got = self.run_job("ranks-to-one", "one", 3, 2, os.path.join(ranks[2], "run", "checkpoint-2"))
        self.assert_equal_runs("2 ranks' checkpoint resumed by one process", got, ref)
        got = self.run_job("one-to-ranks", "torchrun", 3, 1, os.path.join(ref[2], "run", "checkpoint-2"))
        self.assert_equal_runs("one process's checkpoint resumed by 2 ranks", got, ref)
        print("  a Trainer checkpoint of step 2: 2 ranks -> one process and one process -> 2 ranks end equal to the "
              "uninterrupted run bit for bit")


if __name__ == "__main__":
    unittest.main()
