"""The GPU paths on a real GPU: the device map binds ranks to GPUs, the flow policy acts on
the GPU faster than on the CPU, a bf16 run trains with every GPU rank on its GPU."""

import json

import pytest
import torch

from helpers import hpcvla


@pytest.mark.mpi
@pytest.mark.bench
def test_the_gpu_check_measures_every_gpu_path(tmp_path):
    out = hpcvla("bench", "gpu", "--quick", "--json", tmp_path / "gpu.json", timeout=1800)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads((tmp_path / "gpu.json").read_text())
    assert result["gpus"] == torch.cuda.device_count()
    assert any(d.startswith("cuda:") for d in result["devices"].values())
    assert result["presets"]["flow/tiny"]["device"].startswith("cuda")
    assert result["flow_inference"]["gpu"]["dtype"] == "bfloat16"
    ranks = result["reach_training"]["ranks"]
    assert all("cuda" in v and "bfloat16" in v for v in ranks.values()
               if v.startswith(("inference", "learner")))
    sim = result["maniskill_gpu_sim"]  # skipped, saying why, without SAPIEN's GPU library
    assert "skipped" in sim or all(r["env_steps_per_s"] > 0 for r in sim.values()), sim
    memory = result["memory_model"]  # skipped, saying why, without LIBERO
    assert "skipped" in memory or all(0.9 < r < 1.1 for row in memory.values()
                                      for r in row["predicted_over_measured"].values()), memory
    assert result["modes_real"]["modes"]


def test_ranks_sample_their_own_cuda_noise_after_building_the_policy():
    """Each rank seeds its streams (seeds.seed_rank), then builds the policy from run.seed:
    the build must leave the rank's CUDA stream as it was."""
    from hpcvla.config import load_config
    from hpcvla.envs import env_spec
    from hpcvla.factory import build_policy
    from hpcvla.seeds import seed_rank
    cfg = load_config(None, [])
    draws = []
    for rank in (0, 1):
        seed_rank(cfg, rank)
        build_policy(cfg, env_spec(cfg.env), torch.device("cuda", 0))
        draws.append(torch.randn(4, device="cuda"))
    assert not torch.equal(*draws), draws


def test_egl_lists_the_cuda_device_mujoco_renders_on():
    from hpcvla.envs.egl import egl_cuda_ordinals, egl_device
    ordinals = egl_cuda_ordinals()
    assert 0 <= egl_device(ordinals, 0) < len(ordinals), ordinals


def test_flow_inference_is_faster_on_the_gpu():
    from hpcvla.bench.gpu import flow_inference
    result = flow_inference(torch.device("cuda", 0), quick=False)
    assert result["gpu_speedup"] > 1.0, result


def test_pinned_staging_delivers_exact_batches():
    import numpy as np

    from hpcvla.devices import HostStaging
    staging = HostStaging(torch.device("cuda", 0))
    parts = [np.random.default_rng(i).integers(0, 255, (4, 8, 8, 3), dtype=np.uint8)
             for i in range(3)]
    for _ in range(2):  # the buffer is reused
        out = staging.to_device({"image": staging.gather("image", parts)})["image"]
        assert out.is_cuda and torch.equal(out.cpu(), torch.from_numpy(np.concatenate(parts)))


def test_replicas_are_compared_by_their_bits_on_the_gpu():
    """optimizer_state._digest on a GPU: the integer sum of the words there, no host copy."""
    from hpcvla.checkpoint.optimizer_state import _digest
    for dtype in (torch.float32, torch.bfloat16):
        value = torch.randn(1 << 20, device="cuda").to(dtype)
        replica = value.clone()
        assert _digest(value) == _digest(replica)
        replica.view(torch.int16 if dtype == torch.bfloat16 else torch.int32)[12345] ^= 1
        assert _digest(value) != _digest(replica)
