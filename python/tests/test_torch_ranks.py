"""strata.torch with data-parallel ranks (issue 14): `mpirun -np 2 python
_ranks_worker.py` (MPI) and `torchrun --nproc-per-node 2 _ranks_worker.py`
(TCP, also after the worker's own init_process_group) train the tests' small Llama through
strata.torch.initialize, each rank on its own row of every batch of 2, and
one process here trains the same model on the same rows as 2 accumulated
micro-batches (rank order) with gradient_accumulation_steps 2. ZeRO stage 3
and stage 2 (parameters whole on every rank), optimizer states on NVMe,
clipping off: the final weights (engine.state_dict(), gathered on every
rank) and every loss are bit-identical. The exactness: backward(loss / 2) is
exactly half of backward(loss) (a power of two), so the one process
accumulates g0/2 + g1/2 = (g0 + g1)/2, what the ranks' sum averaged over 2
gives; the engine's rank-order sum is the one-rank accumulation order.
save_pretrained is written by rank 0 only.

Needs mpirun and a package built with MPI: skipped without them, a failure
instead under STRATA_REQUIRE_REFERENCE=1 (CI).
"""
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import unittest

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import strata
import strata.torch as st

VOCAB = 96
HERE = os.path.dirname(os.path.abspath(__file__))


def mpirun():
    exe = shutil.which("mpirun")
    if exe is None and os.environ.get("STRATA_REQUIRE_REFERENCE") == "1":
        raise AssertionError("mpirun is not installed and STRATA_REQUIRE_REFERENCE=1 (apt-get install openmpi-bin)")
    return exe


class RanksTest(unittest.TestCase):
    reference = {}  # stage -> the one-process run's (losses, state)

    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="strata-torch-ranks-", dir=os.environ.get("STRATA_TEST_DIR"))

    def tearDown(self):
        shutil.rmtree(self.dir, ignore_errors=True)

    def one_process(self, stage, nvme):
        """The reference: one process, the ranks' rows as accumulated micro-batches."""
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                             initializer_range=0.1))
        cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2, "gradient_clipping": 0.0,
               "optimizer": {"type": "AdamW", "params": {"lr": 2e-3, "weight_decay": 0.01}},
               "zero_optimization": {"stage": stage, "offload_param": {"device": "cpu"},
                                     "offload_optimizer": {"device": "nvme", "nvme_path": nvme}}}
        engine, _, _, _ = st.initialize(model=model, config=cfg)
        self.assertEqual((engine.rank, engine.world_size), (0, 1))
        g = torch.Generator().manual_seed(1)
        data = [torch.randint(0, VOCAB, (2, 33), generator=g) for _ in range(4)]
        losses = []
        for x in data:
            for r in range(2):
                mine = x[r:r + 1]
                logits = engine(input_ids=mine[:, :-1]).logits
                loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), mine[:, 1:].reshape(-1))
                engine.backward(loss)
                engine.step()  # steps at the accumulation boundary only
                losses.append(loss.item())
        state = engine.state_dict()
        self.assertEqual(engine.stats()["comm_bytes"], 0)
        engine.destroy()
        return losses, state

    def two_ranks(self, launcher, cmd, env, stage, pg=False, extra=()):
        """The 2-rank job launched by `cmd`, against the one-process reference."""
        out = os.path.join(self.dir, f"{launcher}-stage{stage}{'-pg' if pg else ''}")
        nvme = out + "-nvme"
        os.makedirs(out)
        os.makedirs(nvme)
        r = subprocess.run(cmd + [os.path.join(HERE, "_ranks_worker.py"), out, str(stage), nvme] +
                           (["pg"] if pg else []) + list(extra),
                           env=env, capture_output=True, text=True, timeout=600)
        self.assertEqual(r.returncode, 0, f"{launcher}, stage {stage}: the 2-rank job failed:\n{r.stdout[-3000:]}\n"
                                          f"{r.stderr[-3000:]}")
        ranks = []
        for k in range(2):
            with open(os.path.join(out, f"losses{k}.json")) as f:
                ranks.append(json.load(f))
        self.assertEqual([x["world_size"] for x in ranks], [2, 2])
        self.assertTrue(all(x["comm_bytes"] > 0 for x in ranks))
        for x in ranks:
            self.assertIn("writing", x["latest_error"] or "", f"rank {x['rank']}: a failed `latest` did not raise")
            self.assertIn("latest failed", x["latest_error"])
        if stage not in self.reference:
            self.reference[stage] = self.one_process(stage, os.path.join(self.dir, f"ref{stage}"))
        ref_losses, ref_state = self.reference[stage]
        for step in range(4):
            for k in range(2):
                self.assertEqual(ranks[k]["losses"][step], ref_losses[2 * step + k],
                                 f"{launcher}, stage {stage}, step {step}, rank {k}")
        state = torch.load(os.path.join(out, "state.pt"))
        self.assertEqual(sorted(state), sorted(ref_state))
        for key in ref_state:
            self.assertTrue(torch.equal(state[key], ref_state[key]), f"{launcher}, stage {stage}: {key} differs")
        self.assertTrue(os.path.isfile(os.path.join(out, "model", "config.json")))
        print(f"  {launcher}{' after init_process_group' if pg else ''}, stage {stage}: 2 ranks x 4 steps equal "
              f"one process of 2 micro-batches bit for bit (losses {[round(x, 4) for x in ref_losses]}); "
              f"sent per rank: {ranks[0]['comm_bytes']} bytes")

    def test_two_ranks_equal_one_process_of_two_micro_batches(self):
        exe = mpirun()
        if exe is None:
            self.skipTest("mpirun is not installed")
        env = dict(os.environ, OMPI_MCA_btl_vader_single_copy_mechanism="none",
                   OMPI_MCA_rmaps_base_oversubscribe="1", OMP_NUM_THREADS="1")
        for stage in (3, 2):
            self.two_ranks("mpirun", [exe, "--oversubscribe", "--allow-run-as-root", "-np", "2", sys.executable],
                           env, stage)

    def test_torchrun_ranks_equal_one_process_over_tcp(self):
        # CPU ranks under torchrun meet over TCP through its agent's TCPStore;
        # also after the script's own init_process_group("gloo") (the store
        # then serves both).
        # TMPDIR: torchrun leaves a torchelastic_* log directory there.
        env = dict(os.environ, OMP_NUM_THREADS="1", TMPDIR=self.dir)
        for key in ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "RANK", "WORLD_SIZE"):
            env.pop(key, None)
        for stage, pg in ((3, False), (2, False), (3, True)):
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            self.two_ranks("torchrun", [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                                        "--master-addr", "127.0.0.1", "--master-port", str(port)], env, stage, pg)

    def test_a_process_group_without_the_launchers_environment(self):
        # torch.multiprocessing.spawn, each process making the group with
        # init_process_group(rank=, world_size=): no RANK or WORLD_SIZE in
        # the environment, so the engine takes the group's ranks and meets
        # the others through its TCPStore (tcp:// init_method; env:// with
        # MASTER_ADDR=localhost as in PyTorch's DDP tutorial; and with
        # WORLD_SIZE exported but no RANK, which the engine's launch
        # detection alone would refuse as a partial torchrun environment).
        env = dict(os.environ, OMP_NUM_THREADS="1")
        for key in ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR",
                    "MASTER_PORT"):
            env.pop(key, None)
        for stage, how in ((3, "tcp"), (2, "env"), (1, "env-ws")):
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            self.two_ranks(f"spawn-{how}", [sys.executable], env, stage, extra=("spawn", how, str(port)))

    def test_a_process_group_on_a_file_store_is_refused_by_name(self):
        # A group of 2 on a FileStore (file:// init_method): nothing for the
        # engine to meet the other rank through. One process: torch's "fake"
        # backend makes the group without a second rank (gloo would wait for
        # it); the group is never used.
        import torch.testing._internal.distributed.fake_pg  # noqa: F401 (registers "fake")
        store = torch.distributed.FileStore(os.path.join(self.dir, "store"), 2)
        torch.distributed.init_process_group("fake", store=store, rank=0, world_size=2)
        try:
            with self.assertRaisesRegex(NotImplementedError, "store is a FileStore.*TCPStore"):
                st.initialize(model=torch.nn.Linear(4, 4), config={"optimizer": {"type": "AdamW"}})
        finally:
            torch.distributed.destroy_process_group()

    def test_a_launch_it_cannot_join_is_refused_by_name(self):
        # A partial torchrun environment: named by the engine's launch detection.
        os.environ["WORLD_SIZE"] = "2"
        try:
            with self.assertRaisesRegex(strata.StrataError, "WORLD_SIZE.*RANK|RANK.*WORLD_SIZE"):
                st.initialize(model=torch.nn.Linear(4, 4), config={"optimizer": {"type": "AdamW"}})
        finally:
            del os.environ["WORLD_SIZE"]
        with self.assertRaisesRegex(TypeError, "mpi_comm must be an mpi4py communicator"):
            st.initialize(model=torch.nn.Linear(4, 4), config={"optimizer": {"type": "AdamW"}}, mpi_comm="world")

    def test_the_comm_timeout_is_deepspeeds(self):
        # As DeepSpeed's process group: DEEPSPEED_TIMEOUT minutes (10 by
        # default), or the timeout of torch.distributed's default group.
        from strata.torch.engine import _comm_timeout_s
        saved = os.environ.pop("DEEPSPEED_TIMEOUT", None)
        try:
            self.assertEqual(_comm_timeout_s(), 600.0)
            os.environ["DEEPSPEED_TIMEOUT"] = "3"
            self.assertEqual(_comm_timeout_s(), 180.0)
            for bad in ("1.5", "ten", "0", "-2"):
                os.environ["DEEPSPEED_TIMEOUT"] = bad
                with self.assertRaisesRegex(ValueError, f"DEEPSPEED_TIMEOUT='{bad}'"):
                    _comm_timeout_s()
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            import datetime
            torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                                                 world_size=1, timeout=datetime.timedelta(seconds=123))
            try:
                self.assertEqual(_comm_timeout_s(), 123.0)  # the group's, over DEEPSPEED_TIMEOUT
            finally:
                torch.distributed.destroy_process_group()
        finally:
            os.environ.pop("DEEPSPEED_TIMEOUT", None)
            if saved is not None:
                os.environ["DEEPSPEED_TIMEOUT"] = saved

    def rank1_beside_a_silent_rank0(self, code, once_connected=lambda p: None):
        """Runs `code` as rank 1 of 2 (torchrun's environment) whose rank 0's
        "store" takes the connection and never replies; once rank 1 has
        connected (it is inside the C call's wait), once_connected(process).
        Returns (process, stdout, stderr, seconds from then to its exit)."""
        store = socket.socket()
        store.bind(("127.0.0.1", 0))
        store.listen(4)
        store.settimeout(120)
        env = dict(os.environ, RANK="1", WORLD_SIZE="2", LOCAL_RANK="1", LOCAL_WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.getsockname()[1]))
        p = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
        try:
            conn, _ = store.accept()  # (torch's import and the rest of the start-up are behind)
            once_connected(p)
            t0 = time.monotonic()
            out, err = p.communicate(timeout=120)
            waited = time.monotonic() - t0
            conn.close()
        finally:
            store.close()
            if p.poll() is None:
                p.kill()
                p.communicate()
        return p, out, err, waited

    def test_a_rank_that_never_answers_fails_after_the_groups_timeout(self):
        # Rank 1 in a process whose default group was made with a 3 s
        # timeout, beside a silent rank 0: the engine waits the group's 3 s,
        # not the library's 300 s, and names the rendezvous.
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            pg_port = s.getsockname()[1]
        code = ("import datetime, torch, strata.torch as st\n"
                f"torch.distributed.init_process_group('gloo', init_method='tcp://127.0.0.1:{pg_port}', rank=0, "
                "world_size=1, timeout=datetime.timedelta(seconds=3))\n"
                "st.initialize(model=torch.nn.Linear(4, 4), config={'optimizer': {'type': 'AdamW'}})\n"
                "print('joined', flush=True)\n")
        p, out, err, waited = self.rank1_beside_a_silent_rank0(code)
        self.assertNotEqual(p.returncode, 0, out)
        self.assertNotIn("joined", out)
        self.assertIn("rendezvous at 127.0.0.1:", err)
        self.assertIn("(rank 1 of 2)", err)
        self.assertLess(waited, 40.0, err)  # (not 300 s; the process's exit under load takes some)
        print(f"  rank 1 gave up on a silent rank 0 {waited:.1f} s after it connected (the group's 3 s timeout): "
              f"{err.strip().splitlines()[-1][:160]}")

    def test_ctrl_c_while_waiting_for_the_other_ranks_ends_the_wait(self):
        # Rank 1 of 2 whose rank 0 never answers waits for it up to the
        # timeout (DeepSpeed's 10 minutes). Ctrl-C there must end the wait at once:
        # Python cannot run its handler during the call into C, so the call
        # runs on a thread of its own and the interruption sets its stop flag
        # (C ABI API 12). Before, the process went on waiting for minutes. The
        # signal comes while rank 1 is inside the C call's wait.
        code = ("import torch, strata.torch as st\n"
                "st.initialize(model=torch.nn.Linear(4, 4), config={'optimizer': {'type': 'AdamW'}})\n"
                "print('joined', flush=True)\n")

        def interrupt(p):
            time.sleep(0.3)
            self.assertIsNone(p.poll(), "rank 1 did not wait for rank 0")
            p.send_signal(signal.SIGINT)

        p, out, err, waited = self.rank1_beside_a_silent_rank0(code, interrupt)
        self.assertNotEqual(p.returncode, 0)
        self.assertIn("KeyboardInterrupt", err)
        self.assertNotIn("joined", out)
        self.assertLess(waited, 30.0, err)
        print(f"  Ctrl-C ended rank 1's wait for rank 0 after {waited:.2f} s (exit {p.returncode})")

if __name__ == "__main__":
    unittest.main()
