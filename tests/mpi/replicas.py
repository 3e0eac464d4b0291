"""Under MPI (2 ranks), every rank a stage-0 learner whose optimizer state is replicated:
`optimizer_state.replicas_agree` passes where the ranks stepped the same model on the same
gradients, and raises on every rank, naming the learner, where one rank's copy differs (in
its weights, or in one bit of one moment).

    mpiexec -n 2 python -m mpi4py tests/mpi/replicas.py
"""

from types import SimpleNamespace

import torch
from mpi4py import MPI

from hpcvla.checkpoint.optimizer_state import fragments, replicas_agree


def learner(seed: int) -> SimpleNamespace:
    """A replicated learner as the Horovod engine holds it: the module and its torch Adam."""
    torch.manual_seed(seed)
    module = torch.nn.Linear(4, 3)
    optimizer = torch.optim.Adam(module.parameters(), lr=1e-2)
    module(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    return SimpleNamespace(module=module, optimizer=optimizer)


world = MPI.COMM_WORLD
# the same model stepped the same way: replicas
replicas_agree(fragments(learner(0), world.rank), world)
for case in ("other weights", "one bit"):
    replica = learner(world.rank if case == "other weights" else 0)
    if case == "one bit" and world.rank == 1:
        moment = replica.optimizer.state[replica.module.weight]["exp_avg_sq"]
        moment.view(-1).view(torch.int32)[5] ^= 1
    try:
        replicas_agree(fragments(replica, world.rank), world)
    except RuntimeError as err:
        assert "learners [1]" in str(err), err
        print(f"rank {world.rank}: differing replicas refused ({case})", flush=True)
    else:
        raise SystemExit(f"differing replicas were not noticed ({case})")
