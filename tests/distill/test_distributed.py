"""Data-parallel training pieces on the CPU with two gloo processes (the CUDA/NCCL run needs 2 GPUs)."""

import json
import os
import socket
import warnings
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from mlff_distiller.distill.distributed import DistInfo, dist_info, setup, shard, teardown


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _molecules():
    from ase.build import molecule

    mols = [molecule(n) for n in ("H2O", "CH4", "C2H6", "NH3", "CH3OH", "HCOOH")]
    for k, a in enumerate(mols):
        a.rattle(0.05, seed=k)
    return mols


def _batch(mols):
    """One graph for a shard (training runs one forward per step) and made-up targets."""
    from mlff_distiller.batch import AtomsBatch
    from mlff_distiller.neighbors import neighbor_list_batch

    b = AtomsBatch.from_atoms(mols, dtype=torch.float64)
    nl = neighbor_list_batch(b, 4.0)
    gen = torch.Generator().manual_seed(b.num_atoms)
    return (
        b,
        nl,
        torch.randn(b.num_atoms, 3, dtype=torch.float64, generator=gen),
        torch.randn(b.num_structures, dtype=torch.float64, generator=gen),
    )


def _model():
    from mlff_distiller import StudentModel

    torch.manual_seed(0)
    return StudentModel(species=[1, 6, 7, 8], hidden=16, layers=2, n_rbf=6, cutoff=4.0).double()


def _loss(module, batch):
    """Energy + force MSE, forces by autograd.grad with create_graph=True (as the trainer does)."""
    b, nl, f_target, e_target = batch
    pos = b.positions.clone().requires_grad_(True)
    e = module(b.numbers, pos, nl.edge_index, nl.shift_vectors, b.batch, b.num_structures)["energy"]
    (g,) = torch.autograd.grad(e.sum(), pos, create_graph=True)
    return ((e - e_target) ** 2).mean() + ((-g - f_target) ** 2).mean()


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    import faulthandler

    stacks = open(os.path.join(out_dir, f"stacks{rank}.txt"), "w")  # open until the process ends
    faulthandler.dump_traceback_later(HANG_S / 2, file=stacks)  # a hang leaves its stacks
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank)
    )
    torch.set_num_threads(1)
    info, device = setup("cpu")
    assert info.enabled and info.rank == rank and device.type == "cpu"
    mols = _molecules()
    mine = _batch([mols[k] for k in shard(list(range(len(mols))), info)])
    model = _model()
    ddp = info.wrap(model, device)
    for _ in range(2):  # two steps: the reducer must re-arm after each backward
        model.zero_grad(set_to_none=True)
        _loss(ddp, mine).backward()
    grads = [p.grad.detach().clone() for p in model.parameters()]
    flag = info.broadcast_flag(rank == 0, device)  # rank 0 says True, everyone hears True
    mean = info.mean(float(rank), device)
    torch.save({"grads": grads, "flag": flag, "mean": mean}, os.path.join(out_dir, f"rank{rank}.pt"))
    teardown(info)
    faulthandler.cancel_dump_traceback_later()


HANG_S = 240  # a multi-process job still running after this is taken as hung (it takes ~10 s here)


def _spawn(world: int, out_dir: Path) -> bool:
    """``mp.spawn`` of :func:`_worker` that gives up after ``HANG_S``: ``False`` then (the workers killed)."""
    import time

    ctx = mp.spawn(_worker, args=(world, _free_port(), str(out_dir)), nprocs=world, join=False)
    deadline = time.monotonic() + HANG_S
    while not ctx.join(timeout=2):
        if time.monotonic() > deadline:
            for proc in ctx.processes:
                proc.kill()
            return False
    return True


def test_dist_info_and_shard(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    info = dist_info()
    assert info == DistInfo() and not info.enabled and info.is_main
    assert shard([1, 2, 3], info) == [1, 2, 3]
    assert shard(list(range(7)), DistInfo(rank=1, world_size=3)) == [1, 4]
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "5")
    with pytest.raises(ValueError, match="inconsistent"):
        dist_info()
    monkeypatch.setenv("RANK", "one")
    with pytest.raises(ValueError, match="RANK"):
        dist_info()


def test_setup_checks_the_device_like_the_engine(monkeypatch):
    """One process, no torchrun: ``setup`` returns the requested device, and an unavailable or unknown one is the
    engine's ValueError (before, a non-CUDA name such as "mps" silently became the CPU)."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    info, device = setup("cpu")
    assert not info.enabled and device == torch.device("cpu")
    with pytest.raises(ValueError, match="runs on 'cpu' or 'cuda'"):
        setup("mps")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert setup("auto")[1] == torch.device("cpu")
    with pytest.raises(ValueError, match="CUDA is not available"):
        setup("cuda")


@pytest.mark.timeout(600)
def test_two_process_ddp_force_training_gradients_equal_one_process(tmp_path):
    """DDP over 2 gloo processes with an energy + force loss (double backward) gives the gradient of the whole batch:
    the mean of the two shards' losses, computed here in one process."""
    world = 2
    for attempt in range(2):  # a hang (stop 23 saw one in the torchrun test's teardown) is run once more
        out = tmp_path / f"attempt{attempt}"
        out.mkdir()
        if _spawn(world, out):
            break
        assert attempt == 0, f"the gloo processes hung twice; stacks:\n{_stacks(out)}"
        stacks = _stacks(out)
        warnings.warn(
            f"the gloo processes hung (killed after {HANG_S} s), running them again; stacks:\n{stacks}", stacklevel=1
        )
    results = [torch.load(out / f"rank{r}.pt") for r in range(world)]
    mols = _molecules()
    model = _model()
    shards = [_batch([mols[k] for k in range(len(mols))[r::world]]) for r in range(world)]
    loss = sum(_loss(model, s) for s in shards) / world
    loss.backward()
    want = [p.grad for p in model.parameters()]
    for res in results:
        assert res["flag"] is True and res["mean"] == pytest.approx(0.5)
        for g, w in zip(res["grads"], want, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)
    # a one-process gradient of a single shard is different: the test can tell shards apart
    model.zero_grad()
    _loss(model, shards[0]).backward()
    assert not all(torch.allclose(p.grad, w) for p, w in zip(model.parameters(), want, strict=True))


_CHILD = """
import faulthandler, json, os, sys
import torch
from mlff_distiller.distill import TrainConfig, read_frames, split_frames, train

labels, out = sys.argv[1], sys.argv[2]
rank = os.environ["RANK"]
torch.set_num_threads(1)
stacks = open(os.path.join(out, f"stacks{rank}.txt"), "w")
faulthandler.dump_traceback_later(float(os.environ["CHILD_STACKS_AFTER_S"]), file=stacks)  # a hang leaves its stacks
train_f, val_f = split_frames(read_frames(labels), 0.2)
cfg = TrainConfig(
    model=dict(hidden=16, layers=2, n_rbf=8, cutoff=4.0), batch_size=8, lr=3e-3, warmup_steps=2, eval_every=6,
    ema_decay=0.9, device="cpu", dtype="float64", patience=0, max_steps=12, train_step="plain",
)
res = train(train_f, val_f, cfg, os.path.join(out, "run"))
torch.save({k: v.detach().cpu() for k, v in res.model.state_dict().items()}, os.path.join(out, f"final{rank}.pt"))
with open(os.path.join(out, f"result{rank}.json"), "w") as f:
    json.dump({"steps": res.steps, "rows": len(res.history), "loss": [h["train_loss"] for h in res.history]}, f)
faulthandler.cancel_dump_traceback_later()
"""


def _torchrun(script, args, out_dir, timeout: float):
    """``torchrun --standalone --nproc_per_node 2 script args``; ``None`` if it hangs past ``timeout`` (then the
    launcher and its workers are killed, not left running; the stack dumps faulthandler wrote after ``timeout / 2``
    are in ``out_dir/stacks<rank>.txt`` and ``out_dir/stacks_launcher.txt``)."""
    import signal
    import subprocess
    import sys

    env = {**os.environ, "OMP_NUM_THREADS": "1", "CHILD_STACKS_AFTER_S": str(timeout / 2)}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(name, None)
    launcher = (  # torchrun itself, with a stack dump of the launcher too
        "import faulthandler, sys; from torch.distributed.run import main; "
        f"faulthandler.dump_traceback_later({timeout / 2}, file=open({str(out_dir / 'stacks_launcher.txt')!r}, 'w')); "
        "main(sys.argv[1:]); faulthandler.cancel_dump_traceback_later()"
    )
    cmd = [sys.executable, "-c", launcher, "--standalone", "--nproc_per_node", "2", str(script)]
    proc = subprocess.Popen(
        [*cmd, *map(str, args)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        for pid in [proc.pid, *_descendants(proc.pid)]:  # the workers run in sessions of their own
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.communicate()
        return None
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (Linux ``/proc``)."""
    parent = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parent[int(stat.parent.name)] = int(fields[1])
    found, frontier = [], [pid]
    while frontier:
        kids = [c for c, p in parent.items() if p in frontier]
        found += kids
        frontier = kids
    return found


def _stacks(out_dir) -> str:
    return "\n".join(f"{p.name}:\n{p.read_text()[-4000:]}" for p in sorted(out_dir.glob("stacks*.txt")))


@pytest.mark.timeout(600)
def test_torchrun_two_processes_train_in_step(emt_labels, tmp_path):
    """`torchrun --nproc_per_node 2` of train(): both ranks run the same number of steps, end with identical
    weights, validate on the same schedule, and only rank 0 writes the run directory."""
    # One CI run (stop 23) hung after rank 0 had logged the end of training, i.e. in the process group's teardown
    # or at exit, and never here in about 20 runs. A hang past HANG_S is killed and the job is run once more in a
    # fresh directory; the hung attempt's stack dumps are reported as a warning. Two hangs fail the test.
    script = tmp_path / "child.py"
    script.write_text(_CHILD)
    proc = None
    for attempt in range(2):
        out = tmp_path / f"attempt{attempt}"
        out.mkdir()
        proc = _torchrun(script, [emt_labels, out], out, timeout=HANG_S)
        if proc is not None:
            break
        stacks = _stacks(out)
        assert attempt == 0, f"torchrun hung twice; stacks of the second attempt:\n{stacks}"
        warnings.warn(f"torchrun hung (killed after {HANG_S} s), running it again; stacks:\n{stacks}", stacklevel=1)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = [json.loads((out / f"result{r}.json").read_text()) for r in range(2)]
    assert results[0]["steps"] == results[1]["steps"] == 12
    assert results[0]["rows"] == results[1]["rows"] == 2
    assert results[0]["loss"] == results[1]["loss"], "rank-averaged training loss reported on every rank"
    w0, w1 = (torch.load(out / f"final{r}.pt") for r in range(2))
    for k in w0:
        torch.testing.assert_close(w0[k], w1[k], rtol=0, atol=0)
    run = out / "run"
    assert (run / "best.pt").exists() and (run / "history.json").exists() and (run / "train_state.pt").exists()
    assert len(json.loads((run / "history.json").read_text())) == 2
    assert "stopped (max_steps)" in proc.stderr  # rank 0 logs
    assert proc.stderr.count("stopped (max_steps)") == 1, "ranks other than 0 are silent"
