"""The memory plan (hpcvla/memory/): the model against DeepSpeed, measured and estimated, and
`hpcvla plan` / the launcher refusing what does not fit. The whole comparison is
`hpcvla bench memory` (docs/memory.md)."""

import json

import pytest

from hpcvla.bench import memory as bench
from hpcvla.cli import main
from hpcvla.config import ConfigError, load_config
from hpcvla.envs import env_spec
from hpcvla.memory.footprint import policy_footprint, shallow_footprint, whole_footprint
from hpcvla.memory.layout import memory_problems
from hpcvla.memory.sft_eval import eval_devices, eval_memory, sft_memory
from hpcvla.memory.states import inference_bytes, learner_bytes
from hpcvla.topology.plan import PlanError, plan_from_config

PI0_FULL = ["configs/libero_pi0.yaml", "policy.pretrained=", "policy.tokenizer=",
            "policy.size=full", "env.image_size=224"]


@pytest.mark.slow
def test_model_states_at_full_size_are_deepspeeds_estimates():
    """π0 and OpenVLA-OFT in bf16, 8 learners, ZeRO-2 and -3: within 5 % of DeepSpeed's
    own estimators (bench.full_size_states leaves out what they omit: the gradient bucket and
    ZeRO-3's gradient partition)."""
    states = bench.full_size_states(learners=(8,))
    assert set(states) == {f"{p} ZeRO-{s} x8" for p in ("pi0", "oft") for s in (2, 3)}
    assert states["pi0 ZeRO-2 x8"]["params"] > 3e9 and states["oft ZeRO-2 x8"]["params"] > 7e9
    for key, row in states.items():
        assert 0.95 <= row["ratio"] <= 1.05, (key, row)


@pytest.mark.slow
def test_the_model_predicts_a_deepspeed_learners_measured_peak():
    """A real DeepSpeed learner (ZeRO-0, the small flow policy, 64 observations) in a fresh
    process: its measured peak above the weights is within 15 % of the model's."""
    row = bench.peaks(["flow-small-z0"])["flow-small-z0"]
    assert row["measured"] > 500 * 2 ** 20, row  # the activations dominate: a real peak
    assert 0.85 <= row["predicted_over_measured"] <= 1.15, row


@pytest.mark.slow
def test_the_model_predicts_an_sft_learners_measured_peak():
    """`hpcvla sft`'s learner (flow matching, ZeRO-0, 64 chunks) in a fresh process: its
    measured peak within 20 % of the model's imitation figure, over on the safe side (the
    model adds a GPU allocator's 10 % slack to the activations; the RL case above is 12 %
    over, and a run varies by ~5 %)."""
    row = bench.peaks(["flow-small-sft-z0"])["flow-small-sft-z0"]
    assert row["measured"] > 500 * 2 ** 20, row
    assert 0.85 <= row["predicted_over_measured"] <= 1.2, row


@pytest.mark.slow
def test_plan_shows_memory_and_refuses_a_micro_batch_that_does_not_fit(capsys):
    """π0 at full size on an 8-GPU node of 80 GiB: 128 segments of 4 observations per
    backward do not fit; the refusal names the learner ranks, the figure and the knobs."""
    node = ["--world", "8", "--ranks-per-node", "8",
            "placement.per_node={simulator: 4, inference: 2, learner: 2}",
            "placement.gpus_per_node=8", "placement.gpu_memory_gb=80"]
    assert main(["plan", *PI0_FULL, *node, "learner.micro_batch=128"]) == 2
    out, err = capsys.readouterr()
    assert "GPU GiB" in out and "host memory" in out and "busiest GPU" in out, out
    assert "learner.micro_batch = 128: expected a layout that fits: rank(s) 6 on node 0" in err
    assert "learner.zero_stage=2" in err and "512 observations" in err, err


def test_plan_refuses_a_bad_env_setting_naming_it(capsys):
    assert main(["plan", "configs/libero_spatial.yaml", "--world", "4",
                 "env.suite=libero_99"]) == 2
    assert "env.suite = 'libero_99': expected one of libero_spatial" in capsys.readouterr().err


def test_the_launch_check_refuses_gpus_it_would_overfill():
    """memory_problems (preflight.check_launch) on a GPU layout that overfills its GPUs, and
    nothing on a CPU-only one."""
    # 1.4 GiB: the inference rank (CUDA context 1.0 + a small policy) fits, the learner not
    overrides = ["placement.gpus_per_node=4", "placement.gpu_memory_gb=1.4"]
    cfg = load_config("configs/default.yaml", overrides)
    plan = plan_from_config(cfg.placement, 4)
    problems = memory_problems(cfg, plan)
    assert [p[0] for p in problems] == ["learner.micro_batch"], problems
    assert "rank(s) 3 on node 0 cuda:0" in problems[0][2] and "cuda context" in problems[0][2]
    offloaded = load_config("configs/default.yaml", [*overrides, "learner.zero_stage=1",
                                                     "learner.offload_optimizer=true"])
    assert [p[0] for p in memory_problems(offloaded, plan)] == ["learner.micro_batch"]
    cfg = load_config("configs/default.yaml", ["placement.gpus_per_node=0"])
    assert memory_problems(cfg, plan) == []


@pytest.mark.parametrize("config, overrides", [
    ("configs/reach_flow.yaml", ["policy.size=small", "learner.gradient_checkpointing=true"]),
    ("configs/reach_tokens.yaml", ["policy.size=small"]),
    ("configs/reach_flow.yaml", ["policy.name=oft", "policy.size=tiny"]),  # towers skip a layer
])
def test_shallow_copies_give_the_whole_policys_figures(config, overrides):
    """A VLA measured as shallow copies of itself on meta tensors, extrapolated to its depths
    phase by phase (memory/depths.py), has the figures of the whole policy run on CPU fake
    tensors, to the byte (bf16: the CPU's layer-norm dtypes; its flash attention)."""
    cfg = load_config(config, overrides)
    spec = env_spec(cfg.env)
    shallow = shallow_footprint(cfg, spec, 8, 4, on_gpus=True)
    assert shallow is not None and shallow == whole_footprint(cfg, spec, 8, 4, on_gpus=True)


@pytest.mark.parametrize("config, overrides", [
    # flow matching reads the prefix's keys and values, not its last hidden state: checkpointed,
    # a middle layer's backward peaks above the first's and the last's (depths.MIDDLES_BASE)
    ("configs/reach_flow.yaml", ["policy.size=small", "learner.gradient_checkpointing=true"]),
    ("configs/reach_tokens.yaml", ["policy.size=small"]),
    ("configs/reach_oft_l1.yaml", ["policy.size=tiny"]),  # towers skip a layer; the L1 head
])
def test_the_imitation_losss_figures_from_shallow_copies_are_the_whole_policys(config,
                                                                                overrides):
    """`hpcvla sft`'s micro-batch (the family's imitation loss) measured on shallow copies
    equals the whole policy's on CPU fake tensors, to the byte."""
    cfg = load_config(config, overrides)
    spec = env_spec(cfg.env)
    footprint = policy_footprint(cfg, spec, 8, 1, on_gpus=True, imitation=True)
    assert footprint == whole_footprint(cfg, spec, 8, 1, on_gpus=True, imitation=True)
    assert footprint.train_bytes != policy_footprint(cfg, spec, 8, 1, on_gpus=True).train_bytes


def test_sft_learners_hold_their_engine_at_the_imitation_batch_and_refuse_what_overfills():
    """sft_memory: 4 learners on 2 nodes, a GPU each (cuda:0 and cuda:1 of each node), each
    the engine's states at ZeRO-2 over 4 and sft.batch_size chunks through the imitation loss;
    a GPU they overfill is refused once (every learner's alike), naming sft.batch_size, also
    where the moments are offloaded (a learner's figure, not an inference rank's)."""
    cfg = load_config("configs/reach_flow.yaml", ["policy.size=tiny", "learner.zero_stage=2",
                                                  "sft.batch_size=32"])
    spec = env_spec(cfg.env)
    memory = sft_memory(cfg, [0, 0, 1, 1], 2, spec)
    fp = policy_footprint(cfg, spec, 32, 1, on_gpus=True, imitation=True)
    assert memory.device == {0: "cuda:0", 1: "cuda:1", 2: "cuda:0", 3: "cuda:1"}
    assert memory.gpu == {r: learner_bytes(fp, 2, 4, on_gpu=True) for r in range(4)}
    # and each its checkpoint's host copy of its states (12 bytes a trained parameter, 1/4
    # each at ZeRO-2), the first the model's weights too
    snapshot = 12 * fp.trainable // 4
    assert memory.host[3] == {"policy builds": fp.weight_bytes, "checkpoint snapshot": snapshot}
    assert memory.host[0]["checkpoint snapshot"] == snapshot + fp.weight_bytes
    assert memory.problems == []
    for offload in ("false", "true"):
        small = load_config("configs/reach_flow.yaml", [
            "policy.size=tiny", "learner.zero_stage=2", "placement.gpu_memory_gb=1",
            "sft.batch_size=32", f"learner.offload_optimizer={offload}"])
        (problem,) = sft_memory(small, [0, 0], 2, spec).problems
        assert problem[:2] == ("sft.batch_size", 32), problem
        assert "rank(s) 0 on node 0 cuda:0" in problem[2] and "demonstration chunks" in problem[2]
    cpu = sft_memory(cfg, [0, 0], 0, spec)
    assert cpu.gpu == {} and cpu.device == {0: "cpu", 1: "cpu"}
    assert cpu.host[1]["cpu ranks' working memory"] == sum(learner_bytes(
        policy_footprint(cfg, spec, 32, 1, on_gpus=False, imitation=True), 2, 2,
        on_gpu=False).values())
    with pytest.raises(PlanError, match="3 sft learners on a node of 2 GPU"):
        sft_memory(cfg, [0, 0, 0], 2, spec)  # learners never share a GPU


@pytest.mark.slow
def test_shallow_copies_give_full_size_pi0s_figures():
    """π0 at full size (27 SigLIP, 18 Gemma and 18 expert layers; copies of 2 and 3): the
    figures of the whole policy on fake tensors, though the micro-batch's largest phase
    changes with depth (the Gemma backward in the copies, the expert's at full depth: an
    extrapolation of the copies' peaks alone would be 3 % short)."""
    cfg = load_config("configs/reach_flow.yaml", ["policy.size=full", "env.image_size=224"])
    spec = env_spec(cfg.env)
    whole = whole_footprint(cfg, spec, 32, 16, on_gpus=True)
    shallow = shallow_footprint(cfg, spec, 32, 16, on_gpus=True)
    assert shallow is not None and shallow == whole and whole.params > 3e9
    imitation = [footprint(cfg, spec, 32, 1, on_gpus=True, imitation=True)
                 for footprint in (whole_footprint, shallow_footprint)]
    assert imitation[0] == imitation[1], imitation  # hpcvla sft's


TINY_FLOW_ON_4_GPUS = ["configs/reach_flow.yaml", "--world", "4", "placement.gpus_per_node=4",
                        "policy.size=tiny", "learner.micro_batches=2"]


def learner_gib(capsys, *overrides) -> float:
    """The learner GPU's figure (rank 3) of `hpcvla plan --json`."""
    assert main(["plan", *TINY_FLOW_ON_4_GPUS, "--json", "placement.gpu_memory_gb=80",
                 *overrides]) == 0
    return sum(json.loads(capsys.readouterr().out)["memory"]["gpu"]["3"].values()) / 2 ** 30


@pytest.mark.slow
def test_plan_auto_chooses_only_layouts_that_fit_and_turns_the_memory_knobs(capsys):
    """On GPUs too small for the config's micro-batch even at the smallest one the search can
    set (one segment), but not with gradient checkpointing: `plan --auto` turns it on, says
    so, and what it prints fits by `hpcvla plan`."""
    smallest = ["learner.micro_batch=1", "env.shards=16"]
    plain = learner_gib(capsys, *smallest)
    checkpointed = learner_gib(capsys, *smallest, "learner.gradient_checkpointing=true")
    assert checkpointed < plain
    capacity = f"placement.gpu_memory_gb={(plain + checkpointed) / 2:.4f}"
    assert main(["plan", *TINY_FLOW_ON_4_GPUS, "--auto", "--json", "--costs", "balanced",
                 "learner.micro_batch=32", capacity]) == 0
    found = json.loads(capsys.readouterr().out)
    assert found["memory_levers"] == ["learner.gradient_checkpointing=true"]
    best = found["best"]["overrides"]
    assert "learner.gradient_checkpointing=true" in best
    assert main(["plan", *TINY_FLOW_ON_4_GPUS, capacity, *best]) == 0, capsys.readouterr()


def test_the_memory_levers_are_only_those_the_configs_rules_take():
    """One list of memory levers for the plan's advice and `plan --auto`'s search, each kept
    where the config's rules take it: SAC and RLPD refuse ZeRO-3 (the search turned it and
    stopped on a ConfigError, never trying the offload; the advice named it); Horovod has no
    ZeRO stages and refuses the offload and bf16 (the advice named all three)."""
    from hpcvla.config.checks import cross_field_problems
    from hpcvla.memory.levers import memory_levers, turned

    def fields(config, *overrides, automatic_only=False):
        cfg = load_config(config, list(overrides))
        levers = memory_levers(cfg, automatic_only)
        current = cfg
        for lever in levers:  # each turn the search makes is one the rules take
            if automatic_only:
                current = turned(current, lever.field, lever.value)
                assert not cross_field_problems(current), lever
            else:
                assert not cross_field_problems(turned(cfg, lever.field, lever.value)), lever
        return [f"{lever.field}={lever.value}" for lever in levers]
    assert fields("configs/colocated_sac.yaml", "learner.zero_stage=1",
                  automatic_only=True) == ["learner.zero_stage=2",
                                           "learner.offload_optimizer=True"]
    assert fields("configs/reach_flow.yaml", automatic_only=True) == [
        "learner.gradient_checkpointing=True", "learner.zero_stage=2", "learner.zero_stage=3",
        "learner.offload_optimizer=True"]
    assert fields("configs/reach_flow.yaml", "learner.backend=horovod") == [
        "learner.gradient_checkpointing=True", "policy.lora_rank=16"]
    assert fields("configs/reach_flow.yaml", "learner.zero_stage=0") == [
        "learner.gradient_checkpointing=True", "policy.lora_rank=16", "learner.zero_stage=1",
        "learner.zero_stage=2", "learner.zero_stage=3", "policy.dtype=bfloat16"]


def test_offloading_moves_the_optimizer_state_to_host_memory(capsys):
    """learner.offload_optimizer: the learner GPU sheds its masters and moments (plan's GPU
    figure), its host memory takes them; refused where ZeRO does not partition them."""
    figures = {}
    for offload in ("false", "true"):
        assert main(["plan", *TINY_FLOW_ON_4_GPUS, "--json", "placement.gpu_memory_gb=80",
                     f"learner.offload_optimizer={offload}"]) == 0
        memory = json.loads(capsys.readouterr().out)["memory"]
        figures[offload] = memory["gpu"]["3"], memory["host_by_rank"]["3"]
    (gpu, host), (gpu_off, host_off) = figures["false"], figures["true"]
    assert "moments" in gpu and "moments" not in gpu_off and "masters" not in gpu_off
    assert host_off["offloaded moments"] == gpu["moments"] and "offloaded masters" in host_off
    assert sum(gpu_off.values()) < sum(gpu.values()) - gpu["moments"] + 1
    with pytest.raises(ConfigError, match="learner.offload_optimizer"):
        load_config("configs/default.yaml", ["learner.offload_optimizer=true",
                                             "learner.zero_stage=0"])


def test_each_learner_holds_its_checkpoints_copy_of_its_states_in_host_memory(capsys):
    """A checkpoint copies a learner's fp32 masters and AdamW moments to host memory until it
    is written (12 bytes a trained parameter), ZeRO-1 a share each, ZeRO-0 the first learner
    all of it; the first learner also the model's weights. In each learner's host figure."""
    snapshots = {}
    for stage in (0, 1):
        assert main(["plan", "configs/colocated.yaml", "--world", "2", "--json",
                     f"learner.zero_stage={stage}"]) == 0
        memory = json.loads(capsys.readouterr().out)["memory"]
        snapshots[stage] = [memory["host_by_rank"][r]["checkpoint snapshot"] for r in "01"]
    (first0, other0), (first1, other1) = snapshots[0], snapshots[1]
    weights = first1 - other1  # the model's weights, in the first's alone
    assert other0 == 0 and first0 == 2 * other1 + weights and other1 > weights > 0


def test_horovods_learners_each_hold_every_state_whatever_zero_stage_says(capsys):
    """learner.zero_stage is DeepSpeed's: under Horovod each of the two learners holds all its
    moments (the plan partitioned them by the default stage 1 before), whatever the stage."""
    two_learners = ["configs/colocated.yaml", "--world", "2", "placement.gpus_per_node=2",
                    "--json", "placement.gpu_memory_gb=80"]
    figures = []
    for backend, stage in (("horovod", 0), ("horovod", 1), ("horovod", 2), ("deepspeed", 1)):
        assert main(["plan", *two_learners, f"learner.backend={backend}",
                     f"learner.zero_stage={stage}"]) == 0
        figures.append(json.loads(capsys.readouterr().out)["memory"]["gpu"]["1"])
    assert figures[0] == figures[1] == figures[2]
    assert figures[0]["moments"] == 2 * figures[3]["moments"]  # ZeRO-1: half each


def test_each_rings_lane_holds_its_producers_share_of_a_version(capsys):
    """learner.ring_slots=0 (the default): a lane holds what its producer sends a version
    (max_staleness of them: producers run that far ahead while the learner trains): each step's
    observation, actions, scalars and what the policy records beside them (flow's denoising
    chain), an off-policy segment's next observation too, each record's last slot counted
    whole; 32 slots at least (the default job's). π0's LIBERO batch (micro-batch 32 x 4
    passes of 4 steps, 256 px: 96 MiB a version here, 192 from its two cameras) had lanes of
    at most 32 MiB, stopping the rollout most of every version. The plan counts it."""
    from hpcvla.factory import build_policy
    from hpcvla.memory.layout import ring_slots, segments_bytes
    from hpcvla.memory.states import fields_bytes
    from hpcvla.transport.slots import SLOT_HEADER
    big = ["env.image_size=256", "learner.micro_batch=32", "learner.micro_batches=4",
           "rollout.segment_len=4"]
    default = load_config("configs/default.yaml")
    assert ring_slots(default, env_spec(default.env), 1) == 32
    chain = ["configs/reach_flow.yaml", ["policy.logprob_mode=chain", "policy.denoise_steps=8",
                                         "env.image_size=32", "learner.micro_batch=64",
                                         "learner.ring_slot_kib=16"]]
    cases = [("configs/default.yaml", [*big, f"pipeline.max_staleness={s}"]) for s in (1, 2)]
    cases += [tuple(chain), ("configs/colocated_sac.yaml", big)]
    for config, overrides in cases:
        cfg = load_config(config, overrides)
        spec = env_spec(cfg.env)
        recorded = fields_bytes(build_policy(cfg, spec, "meta").extra_fields())
        assert (recorded > 0) == (config == chain[0])
        need = max(1, cfg.pipeline.max_staleness) * segments_bytes(cfg, spec, recorded)
        assert need > 95 * 2**20 or config == chain[0]
        capacity = cfg.learner.ring_slot_kib * 1024 - SLOT_HEADER.itemsize
        for producers in (1, 2, 3):
            lane = ring_slots(cfg, spec, producers, recorded) // producers * capacity
            assert lane >= need / producers, (config, producers)
            assert lane < 1.25 * need / producers
    cfg = load_config(chain[0], chain[1])
    recorded = fields_bytes(build_policy(cfg, env_spec(cfg.env), "meta").extra_fields())
    assert ring_slots(cfg, env_spec(cfg.env), 1, recorded) > ring_slots(cfg, env_spec(cfg.env), 1)
    assert ring_slots(load_config("configs/default.yaml", [*big, "learner.ring_slots=8"]),
                      spec, 2) == 8  # as set
    # a published folder's policy records its chunk in the model's space (model_actions):
    # the meta build the plan counts with, which loads no processor, records it too
    pi0 = load_config("configs/libero_pi0.yaml")
    pi0_spec = env_spec(pi0.env)
    real = build_policy(pi0, pi0_spec).extra_fields()
    assert "model_actions" in real and build_policy(pi0, pi0_spec, "meta").extra_fields() == real
    for config, overrides in (("configs/default.yaml", big), tuple(chain)):
        assert main(["plan", config, "--world", "4", "--json", *overrides]) == 0
        host = json.loads(capsys.readouterr().out)["memory"]["host_by_rank"]["3"]
        cfg = load_config(config, overrides)
        spec = env_spec(cfg.env)
        recorded = fields_bytes(build_policy(cfg, spec, "meta").extra_fields())
        assert host["trajectory rings"] == \
            ring_slots(cfg, spec, 1, recorded) * cfg.learner.ring_slot_kib * 1024


@pytest.mark.slow
def test_a_simulator_ranks_host_figure_is_what_its_envs_take():
    """ManiSkill's envs of one simulator rank in a fresh process: the resident memory they
    take is within 15 % of the rank's host figure (memory/simulators.py)."""
    row = bench.simulators(["maniskill-4-envs"])["maniskill-4-envs"]
    assert row["measured"] > 200 * 2 ** 20, row  # the simulator's libraries: a real figure
    assert 0.85 <= row["predicted_over_measured"] <= 1.15, row


def test_plan_of_an_sft_job_shows_each_learners_gpu_and_refuses_what_overfills(capsys):
    """`hpcvla plan --job sft`: every rank a learner, a GPU each on nodes of
    placement.gpus_per_node (a preview on this CPU host): sft_memory's figures, exit 2 with
    the refusal where they overfill, and no two learners on one GPU."""
    sft = ["configs/reach_flow.yaml", "--job", "sft", "--world", "4", "--ranks-per-node", "2",
           "policy.size=tiny", "placement.gpus_per_node=2"]
    assert main(["plan", *sft, "--json", "placement.gpu_memory_gb=80"]) == 0
    memory = json.loads(capsys.readouterr().out)["memory"]
    assert list(memory["gpu"]) == ["0", "1", "2", "3"] and "activations" in memory["gpu"]["3"]
    assert list(memory["host"]) == ["0", "1"]  # two nodes
    assert main(["plan", *sft, "placement.gpu_memory_gb=1"]) == 2
    out, err = capsys.readouterr()
    assert "4 learner(s), 2 per node, a GPU each; 64 demonstration chunks" in out
    assert "    3    1  cuda:1" in out and "busiest GPU" in out
    assert "does not fit: sft.batch_size = 64: expected a layout that fits" in err
    assert main(["plan", *sft[:-1], "placement.gpus_per_node=1"]) == 2
    assert "2 sft learners on a node of 1 GPU(s): learners never share" in \
        capsys.readouterr().err
    assert main(["plan", *sft, "--auto"]) == 2
    assert "an sft world is learners only" in capsys.readouterr().err


def test_eval_ranks_share_the_gpus_each_with_its_weights_batch_and_context():
    """eval_memory (`hpcvla eval` on this host): 3 evaluating ranks on 2 GPUs, each taking
    the least loaded (cuda:0, 1, 0), each holding the weights, `act` on its --envs
    observations and a CUDA context; a GPU they overfill is refused naming --envs and
    --ranks; on CPUs their working memory is host memory, beside their envs."""
    cfg = load_config("configs/reach_flow.yaml", ["policy.size=tiny"])
    spec = env_spec(cfg.env)
    memory = eval_memory(cfg, eval_devices(cfg, 3, 2), 16, spec)
    fp = policy_footprint(cfg, spec, 1, 16, on_gpus=True)
    assert memory.device == {0: "cuda:0", 1: "cuda:1", 2: "cuda:0"}
    assert memory.gpu == {r: inference_bytes(fp, on_gpu=True) for r in range(3)}
    small = load_config("configs/reach_flow.yaml", ["policy.size=tiny",
                                                    "placement.gpu_memory_gb=1.5"])
    # two contexts on cuda:0
    (problem,) = eval_memory(small, eval_devices(small, 3, 2), 16, spec).problems
    assert problem[:2] == ("--envs", 16) and "rank(s) 0, 2 on node 0 cuda:0" in problem[2]
    assert "fewer episodes at a time per rank (--envs) or fewer ranks per GPU" in problem[2]
    cpu = eval_memory(cfg, eval_devices(cfg, 2, 0), 16, spec)
    assert cpu.gpu == {} and cpu.host[1]["cpu ranks' working memory"] == sum(
        inference_bytes(policy_footprint(cfg, spec, 1, 16, on_gpus=False), False).values())


def test_each_nodes_first_sft_learner_holds_the_demonstrations_copy():
    """sft_memory counts the demonstrations once per node, at its first learner: the files'
    chunk rows (from their headers) times a sample's bytes as the learners hold it."""
    from hpcvla.config.imitation import demo_paths
    from hpcvla.demonstrations import demonstration_rows, sample_bytes
    from hpcvla.memory.sft_eval import DEMOS, demonstration_bytes
    cfg = load_config("configs/libero_spatial.yaml",
                      ["sft.demos=tests/fixtures/demonstrations/libero"])
    spec = env_spec(cfg.env)
    shared = demonstration_bytes(cfg, spec)
    assert shared == demonstration_rows(demo_paths(cfg.sft), spec) * sample_bytes(spec) > 0
    memory = sft_memory(cfg, [0, 0, 1, 1], 0, spec)
    assert [memory.host[r].get(DEMOS) for r in range(4)] == [shared, None, shared, None]


def test_a_slurm_jobs_memory_request_is_its_hosts_memory():
    """Where Slurm enforces --mem by polling, not a cgroup (ConstrainRAMSpace=no), the
    memory the job asked for is still all it may use: host_bytes takes it (SLURM_MEM_PER_NODE
    MiB, or SLURM_MEM_PER_CPU times the node's CPUs), not the machine's. 0 is "the whole
    node"; outside a job the variables say nothing."""
    from hpcvla.memory.host import host_bytes, slurm_memory_limits
    job = {"SLURM_JOB_ID": "7"}
    assert slurm_memory_limits({**job, "SLURM_MEM_PER_NODE": "4096"}) == [4 << 30]
    assert slurm_memory_limits({**job, "SLURM_MEM_PER_CPU": "1024",
                                "SLURM_CPUS_ON_NODE": "6"}) == [6 << 30]
    assert slurm_memory_limits({**job, "SLURM_MEM_PER_NODE": "0"}) == []
    assert slurm_memory_limits({"SLURM_MEM_PER_NODE": "4096"}) == []  # not a job's
    assert host_bytes({**job, "SLURM_MEM_PER_NODE": "4096"}) == min(4 << 30, host_bytes({}))


def test_a_dev_shm_without_room_beside_mpis_own_refuses_prior_data_only():
    """/dev/shm's room beside MPI's own 64 MiB (windows.shared_memory_room) is below zero on
    a container's default 64 MiB: SAC, which keeps no prior data there, is not refused for
    it (0 bytes of prior data were "more than" a negative room); RLPD's prior data is."""
    from hpcvla.config import load_config
    from hpcvla.memory.layout import LayoutMemory, PRIOR, replay_problems
    cfg = load_config(None, ["algorithm.name=sac"])

    def node(prior: int) -> LayoutMemory:
        return LayoutMemory(gpu={}, host={0: {"replay buffers": 1 << 20, PRIOR: prior}},
                            device={0: "cpu"}, node={0: 0}, capacity_gib=0, dtype_bytes=4)
    assert replay_problems(cfg, node(0), 1 << 20, 1 << 40, -(1 << 20)) == []
    (problem,) = replay_problems(cfg, node(1 << 20), 1 << 20, 1 << 40, -(1 << 20))
    assert problem[0] == "algorithm.demos_per_task" and "more than the 0 MiB free" in problem[2]
    assert replay_problems(cfg, node(1 << 20), 1 << 20, 1 << 40, None) == []  # unknown
