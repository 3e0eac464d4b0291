"""Run under MPI (2 ranks): `hpcvla train ARGS` on every rank, rank 1 as on a node given GPUs
that torch cannot see (SLURM_GPUS_ON_NODE=8, a CUDA_VISIBLE_DEVICES naming no device). Only
that node's ranks find the problem: rank 1 must say so, with its host, and end the world.

    hpcvla launch -n 2 -- tests/mpi/train_without_gpus_on_rank_1.py configs/colocated.yaml
"""

import os
import sys

from mpi4py import MPI

from hpcvla.cli import main

if MPI.COMM_WORLD.Get_rank() == 1:
    os.environ.update(SLURM_GPUS_ON_NODE="8",
                      CUDA_VISIBLE_DEVICES="GPU-00000000-0000-0000-0000-000000000000")
sys.exit(main(["train", *sys.argv[1:]]))
