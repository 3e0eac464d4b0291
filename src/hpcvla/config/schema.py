"""Every setting hpcvla reads, with what it does and what it trades off.

A section is a dataclass; a setting is a field declared with `setting(...)`, whose `doc` says
what the value means and what raising or lowering it costs (the style of Sample Factory's
flags). `hpcvla config --doc` prints every setting's documentation, one block per setting.
Sections of their own: config/policy.py, learning.py (algorithm), evaluation.py, imitation.py.

Fields are checked by `hpcvla.config.loader`: types from the annotations, `choices`, and the
numeric bounds `ge`/`le`; then the checks that involve several fields (config/checks.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hpcvla.config.families import EE_DELTA_CONTROL, MANISKILL_REWARDS, SIMULATORS
from hpcvla.config.evaluation import EvalConfig
from hpcvla.config.imitation import SFTConfig
from hpcvla.config.learning import AlgorithmConfig, setting
from hpcvla.config.policy import PolicyConfig
from hpcvla.schedule import MODES


ROLES = ("simulator", "inference", "learner")
PLACEMENT_MODES = ("colocated", "disaggregated", "hybrid")


@dataclass
class RunConfig:
    name: str = setting(
        "default", "Run name; the run directory is `<root>/<name>-<timestamp>` "
        "(`<name>-sft-<timestamp>` for `hpcvla sft`).")
    root: str = setting(
        "runs", "Directory under which run directories are created. Put it on a shared "
        "file system on a cluster so every node's rank 0 sees the same path.", paths=True)
    seed: int = setting(
        0, "Base random seed; each rank derives its own from it and its rank. A "
        "synchronous run (sync-colocated, sync-disaggregated) repeats bit for bit at one "
        "seed; in the asynchronous modes the ranks' timing also shapes the run "
        "(docs/learning.md, \"What a seed fixes\"). 0 .. 2^32 - 1.", ge=0, le=2**32 - 1)
    resume: str = setting(
        "", "Continue the run in this run directory from its newest checkpoint (weights, "
        "optimizer, learners' RNG, policy version, counters) up to "
        "pipeline.total_updates; the run writes on into that directory. Empty: a new run. "
        "Trajectories in flight when the checkpoint was written are not resumed (they were "
        "never trained).", paths=True)
    dump_trajectories: bool = setting(
        False, "Write every episode the producer (inference) ranks send to the learners to "
        "HDF5, one file per producer: `<run dir>/trajectories/rank<R>.h5`, a group an episode "
        "(`hpcvla inspect FILE`), by a writer process per producer. Costs disk (~1 KB a step "
        "at 64 px, gzip; ~5 KB an episode), a core's share (a writer keeps up with a few hundred "
        "episodes/s: reach's short ones outrun it, and the stop waits for its backlog).")
    dump_flush_s: float = setting(
        10.0, "Seconds between appends to the trajectory dumps: a reader, or a run that "
        "died, sees everything up to the last one. Shorter: fresher files, more file opens.",
        ge=0.1)
    tensorboard: bool = setting(
        True, "Write TensorBoard event files to `<run dir>/tensorboard/` as the run goes (the "
        "weight root's losses, its KL and clip fraction from a version's second pass, the "
        "actor's rate, success, return, throughput, staleness; every role's busy fractions at "
        "the end; `hpcvla eval --all`'s curve): `tensorboard --logdir <run.root>` watches them.")
    wandb: str = setting(
        "disabled", "Weights & Biases (its own modes): TensorBoard's scalars against "
        "`trained_env_steps`, with the resolved config, in `<run dir>/wandb/`. `offline` for "
        "compute nodes without internet (`wandb sync <run dir>/wandb/offline-run-*` on a login "
        "node uploads them, one W&B run per run directory); `online` streams (WANDB_API_KEY; "
        "WANDB_PROJECT, default hpcvla, WANDB_ENTITY); `disabled`: off.",
        choices=["disabled", "offline", "online"])
    timeline_s: float = setting(
        3600.0, "Seconds from each start that every rank writes its busy spans, a line each, "
        "to `timeline.rank<R>.jsonl` (report.py's swimlanes); then their totals alone (summary."
        "json). An inference rank writes ~0.3 GB a day of them. 0: none.", ge=0)


@dataclass
class PlacementConfig:
    mode: str = setting(
        "disaggregated",
        "How ranks get roles. `colocated`: every rank simulates, infers and learns in turn "
        "(no extra ranks, but stages cannot overlap on one rank). `disaggregated`: each rank "
        "has one role (stages overlap; needs enough ranks per stage). `hybrid` is plan-only "
        "(`hpcvla plan` and the transport tests; `hpcvla train` refuses it): simulators have "
        "their own ranks, every inference rank also learns (RLinf's hybrid: the GPU shared "
        "by inference and training, simulator CPU work overlapping both).",
        choices=PLACEMENT_MODES)
    ranks_per_node: int = setting(
        0, "Ranks per node. 0 = the real node size (ranks sharing memory, as MPI reports). "
        "A positive value splits each real node into emulated nodes of this many ranks, to "
        "test multi-node layouts on one machine; it must divide the real node size.", ge=0)
    per_node: dict[str, int] = setting(
        {"simulator": 2, "inference": 1, "learner": 1},
        "Rank count per role on every rollout node (disaggregated, hybrid; ignored when "
        "colocated); must sum to ranks_per_node. Simulators of a node are split evenly among "
        "its inference ranks into cells, so inference <= simulator. More simulator ranks "
        "per inference rank give bigger inference batches but longer action waits. In "
        "hybrid mode learner must be 0 (inference ranks learn). The rollout:learner ratio "
        "of the papers (1:1, 2:1, 3:1) is inference ranks : learner ranks.")
    learner_nodes: int = setting(
        0, "Disaggregated only: this many nodes at the end of the allocation hold only "
        "learners (every rank a learner), keeping gradient traffic off the rollout nodes. "
        "0 = learners live on the rollout nodes as per_node says.", ge=0)
    learners: int = setting(
        0, "Disaggregated only: at most this many learner ranks; the ranks beyond (the last "
        "learner ranks of the layout) are spare: they take part in start-up and the report, "
        "hold no GPU and compute nothing. 0 = every learner rank of the layout. Every learner "
        "needs its own producer (an inference rank), so a layout with fewer inference ranks "
        "than learner ranks needs it; a restart on fewer rollout nodes sets it "
        "(jobs/launch.sh).", ge=0)
    evaluators: int = setting(
        0, "Disaggregated only: ranks set aside to evaluate held-out states while training "
        "runs (eval.every > 0 needs one): the last learner rank of the rollout nodes becomes "
        "the evaluator. It reads each version from its node's weight copy, as inference ranks "
        "do, runs its own env batch and policy (a GPU where there are GPUs), and never holds "
        "the learners up. One evaluator evaluates every version it is given, whole; 1 at "
        "most.", ge=0, le=1)
    gpus_per_node: int = setting(
        -1, "GPUs the ranks of a node may use. -1 = detect (CUDA_VISIBLE_DEVICES, or every GPU "
        "torch sees); 0 = CPU only; k = the first k visible (`hpcvla plan` previews a GPU "
        "node with it). Learner ranks get a GPU each, never two learners one GPU; inference "
        "ranks and evaluators one each where there are enough, else they share the least "
        "loaded; simulators one where their simulator renders or simulates on it (devices.py).",
        ge=-1)
    gpu_memory_gb: float = setting(
        0.0, "Memory of one GPU in GiB, for the memory plan (hpcvla/memory/): a layout whose "
        "ranks need more on any GPU is refused before launch (`hpcvla plan` shows the "
        "figures). 0 = the first GPU this host's torch sees; unknown, so nothing refused, "
        "where it sees none (preview a cluster's GPUs from a login node with e.g. 80).", ge=0)


PIPELINE_MODES = MODES  # the modes and their traits: hpcvla/schedule.py


@dataclass
class PipelineConfig:
    mode: str = setting(
        "streamer",
        "Schedule of the three stages (RL-VLA³ ablation ladder; same algorithm in all). "
        "`sync-colocated`: every rank simulates, infers, then trains, in lock-step (needs "
        "placement.mode=colocated). `sync-disaggregated`: roles on their own ranks, taking "
        "turns (rollout waits for training). `train-async`: rollout overlaps training, one "
        "shard, whole-cell batches. `rollout-async`: + env shards and the dynamic batcher. "
        "`streamer`: + the learner trains each micro-batch as soon as it arrives.",
        choices=PIPELINE_MODES)
    max_staleness: int = setting(
        1, "Most policy versions a trained sample may lag the learner (async modes; the sync "
        "modes use 0). Producers pause before exceeding it. Higher keeps simulators busier "
        "while the learner works, but trains on older data (PPO and GRPO correct it with the "
        "decoupled weights; sac/rlpd learn off-policy anyway).", ge=0)
    total_updates: int = setting(
        500, "Policy versions (learner updates) before the run ends; the run's length in "
        "units of learning. A version is learner.epochs (+ algorithm.critic_epochs) optimizer "
        "steps under PPO/GRPO, algorithm.utd gradient steps per new transition under "
        "sac/rlpd.", ge=1)
    progress_every_s: float = setting(
        5.0, "Seconds between progress lines: training's, on the weight root (steps/s, "
        "success, staleness, ETA), `hpcvla sft`'s and `hpcvla demos`'s.", ge=0.1)
    stall_timeout_s: float = setting(
        300.0, "A learner that receives no trajectory for this long stops the job, naming "
        "what it waits for (a stuck simulator, a layout that cannot fill a batch). Longer "
        "than the slowest segment takes. Inference ranks held this long (staleness quota, "
        "full ring lane) name their learner, learners this long in a version say so, each "
        "time, and wait on (a version may take that long; one that hangs says nothing).", ge=1)


@dataclass
class EnvConfig:
    name: str = setting("reach", "Simulator. `reach` is built in (numpy only, pixels + "
                        "instruction, fast); `maniskill` (ManiSkill3, task env.task) and "
                        "`libero` (suite env.suite) are real simulators: far slower per step "
                        "(rendering on CPU), and a LIBERO env takes ~300 MB.",
                        choices=tuple(SIMULATORS))
    task: str = setting(
        "PickCube-v1", "ManiSkill3 task id (env.name=maniskill); the tasks that need no "
        "asset download are listed in hpcvla/envs/maniskill.py (NO_DOWNLOAD_TASKS).")
    sim_backend: str = setting(
        "cpu", "env.name=maniskill: where the physics runs. `cpu`: one single-env ManiSkill "
        "scene per env, stepped one after the other by the rank (PhysX on the CPU; cameras "
        "render on the rank's GPU if it has one). `gpu`: each shard (env.envs_per_simulator / "
        "env.shards envs) is ONE ManiSkill env whose envs PhysX steps together on the rank's "
        "GPU and renders there in one batch: for large shards (ManiSkill steps hundreds of envs "
        "per GPU at once); the same observations, rewards and episodes (but other initial "
        "object poses per init state id than `cpu`). Needs CUDA and PhysX GPU on the "
        "simulator nodes (SAPIEN's PhysX GPU library in ~/.sapien, downloaded on first use: "
        "fetch it beforehand where nodes have no internet). A GPU simulation cannot drop one "
        "failing env: a fault ends every episode of its shard (with env.isolation=process the "
        "shard's worker restarts).", choices=("cpu", "gpu"))
    control_mode: str = setting(
        EE_DELTA_CONTROL, "env.name=maniskill: the robot's controller, which says what an "
        "action is (ManiSkill3's control modes): `pd_ee_delta_pose` end-effector translation "
        "and rotation deltas + gripper (7-d; what VLA checkpoints and the scripted experts "
        "use), `pd_joint_delta_pos` joint-angle deltas + gripper (8-d; what ManiSkill's own "
        "PPO/SAC baselines train), or another mode whose actions are normalized to [-1, 1] "
        "(envs/maniskill.py CONTROL_MODES, checked before launch). Demonstrations: recorded in "
        "it.")
    suite: str = setting(
        "libero_spatial", "LIBERO suite (env.name=libero): libero_spatial, libero_object, "
        "libero_goal, libero_10 or libero_90, or a LIBERO-PRO perturbation of one of the "
        "first four for out-of-distribution evaluation: <suite>_object (other objects), _swap "
        "(positions swapped), _lan (instructions reworded), _task (another task in the same "
        "scene) (envs/libero.py SUITES, checked before launch).")
    suite_task: int = setting(
        -1, "LIBERO task index within env.suite for every env; -1 spreads the envs over all "
        "tasks of the suite (multi-task; each further scene a rank renders costs ~1 GB: "
        "libero_spatial's and libero_goal's tasks share one, envs/scenes.py).",
        ge=-1)
    wrist_image: bool = setting(
        False, "Add the wrist camera (`wrist_image`) next to the third-person `image` "
        "(maniskill, libero): a second render per step (~2x the rendering time).")
    reward: str = setting(
        "sparse", "maniskill: `sparse` (1 on success), `dense_delta` (the dense shaping's "
        "change per step: an episode returns its last value, most at success) or `dense` (the "
        "shaping, unbootstrapped at success: hovering short of it returns more). libero: "
        "sparse; reach: its own.", choices=MANISKILL_REWARDS)
    envs_per_simulator: int = setting(
        16, "Environments each simulator rank steps. More amortise inference per step "
        "but make a synchronous step wait longer for its slowest env.", ge=1)
    shards: int = setting(
        2, "Shards the envs of a simulator rank are split into (rollout-async, streamer): "
        "a shard steps and asks for actions without waiting for the others, so stepping "
        "overlaps inference. More shards: more overlap, smaller inference batches. Must divide "
        "env.envs_per_simulator; the other modes step one shard and ignore it.", ge=1)
    chunk_len: int = setting(
        4, "Primitive actions per action chunk (one policy call per chunk). Longer chunks "
        "mean fewer policy calls but coarser feedback.", ge=1)
    max_episode_chunks: int = setting(
        20, "Episode horizon in chunks; the episode is truncated after this many (the "
        "simulators' own step limits are lifted: horizon = this x chunk_len steps).", ge=1)
    image_size: int = setting(
        32, "Camera image side in pixels: more detail, more bytes per step and a slower "
        "encoder.", ge=16, le=512)
    camera: bool = setting(
        True, "maniskill (CPU simulation) only: render the third-person camera (`image`). "
        "false: state-only observations, nothing rendered (several times the env steps per "
        "second on CPUs); for the `default` policy, which then reads the state and the "
        "instruction; VLA policies read the camera.")
    state: bool = setting(
        True, "Include the low-dim state observation (learning is much faster with it; "
        "turn it off to learn from pixels and instruction alone).")
    state_format: str = setting(
        "quaternion", "libero only: the end-effector orientation in the state. `quaternion`: "
        "9-d state (position 3, xyzw quaternion 4, gripper 2). `axis_angle`: 8-d state, the "
        "quaternion as robosuite's axis-angle vector (3), as openpi's LIBERO example (pi0, "
        "pi0.5) and OpenVLA-OFT feed it: use it with their checkpoints (policy.pretrained), "
        "whose state normalization expects 8 values.",
        choices=("quaternion", "axis_angle"))
    gripper_action: str = setting(
        "closed_high", "libero only: what the last action dimension means. `closed_high`: "
        "LIBERO's controller's own (-1 open, +1 closed). `open_high`: OpenVLA-OFT's LIBERO "
        "datasets' (+1 open, 0 closed), given to LIBERO as OFT's and RLinf's evaluations do "
        "(the sign of 2 g - 1, negated); policy.name=oft on libero needs it.",
        choices=("closed_high", "open_high"))
    latency_median_ms: float = setting(
        0.0, "reach only: emulated simulator cost: a step lasts the slowest of per-env "
        "lognormal draws with this median, its real compute included (0 = off).", ge=0)
    latency_sigma: float = setting(
        0.5, "Log-space spread of the emulated step latency (long tail).", ge=0)
    isolation: str = setting(
        "inline", "Where a simulator rank runs its env shards. `inline`: in the rank's own "
        "process (no extra process or copy). `process`: each shard in a worker subprocess "
        "(hpcvla/envs/isolated.py), so a hung or crashed simulator (deadlock, segfault, OOM "
        "kill) costs a restarted worker and the shard's current episodes, not the job, and "
        "the shards of a rank step concurrently (up to one core each: give the rank as many "
        "cores as shards); costs one process per shard and a copy of every observation.",
        choices=("inline", "process"))
    step_timeout_s: float = setting(
        300.0, "A simulator step (one chunk of one shard) that has not returned after this "
        "many seconds is a hang (a MuJoCo/EGL deadlock). env.isolation=process: the shard's "
        "worker is killed and restarted and the run goes on. inline: the rank prints its "
        "stacks and exits; the launcher names it and stops the job, so a checkpointed run "
        "can be resumed instead of hanging. Must exceed the slowest legitimate step (and reset "
        "and shard build, guarded too; a step gets 0.9-1 x it): 0 = none, else >= 1.",
        ge=0)
    max_restarts: int = setting(
        5, "Restarts of one shard's worker (env.isolation=process), or rebuilds of one env "
        "that raised (inline ManiSkill/LIBERO envs), after which the rank gives up and stops "
        "the job (a fault that always recurs is a bug, not bad luck).", ge=0)
    hang_at_step: int = setting(
        0, "`reach`, fault injection: every env's step number N never returns (tests the "
        "step watchdog). 0 = never.", ge=0)
    crash_at_step: int = setting(
        0, "`reach`, fault injection: the process running the envs is killed (SIGKILL, as "
        "a segfault or the OOM killer would) at step number N. 0 = never.", ge=0)


@dataclass
class RolloutConfig:
    segment_len: int = setting(
        8, "Chunk-steps per trajectory segment sent to a learner (bootstrapped with the "
        "value of the next observation). Longer: better advantages, later delivery.", ge=1)
    batch_max: int = setting(
        0, "B_max of the dynamic batcher, in envs: a forward pass fires once this many "
        "envs wait (0 = all envs of the cell). Larger batches use the accelerator better; "
        "smaller ones answer sooner.", ge=0)
    wait_max_ms: float = setting(
        5.0, "T_max of the dynamic batcher: a forward pass fires once the oldest request "
        "waited this long, full or not.", ge=0)


@dataclass
class LearnerConfig:
    backend: str = setting(
        "deepspeed", "Data-parallel engine of the learner group: `deepspeed` (ZeRO, "
        "`zero_stage`) or `horovod` (MPI allreduce on the learner communicator, every learner "
        "holds everything, float32 policies; where installed: `make install-horovod`).",
        choices=("deepspeed", "horovod"))
    zero_stage: int = setting(
        1, "DeepSpeed ZeRO stage. 0: plain data parallel (fastest, every learner holds "
        "everything). 1: shard optimizer state. 2: + gradients. 3: + parameters (least "
        "memory per learner, most communication).", ge=0, le=3)
    micro_batch: int = setting(
        16, "Env segments per forward/backward on each learner (a multiple of the envs per "
        "shard). The streamer starts one as soon as this many have arrived.", ge=1)
    micro_batches: int = setting(
        2, "Micro-batches accumulated per optimizer step on each learner; the global batch "
        "is micro_batch x micro_batches x learners segments. In the disaggregated modes each "
        "learner's batch must split equally among its producers (inference ranks), each part "
        "a multiple of the envs per shard (checked before launch).", ge=1)
    offload_optimizer: bool = setting(
        False, "DeepSpeed ZeRO-Offload: the fp32 master weights, fp32 gradients and AdamW "
        "moments live in (pinned) host memory and the optimizer steps there (torch's fused "
        "AdamW on the CPU): a learner GPU keeps only the weights, gradients and "
        "activations, 16 of the 18 bytes per trained parameter off it, for a CPU step and the "
        "gradients' trip over PCIe each optimizer step. Needs learner.zero_stage >= 1, "
        "learner.backend=deepspeed.")
    gradient_checkpointing: bool = setting(
        False, "Recompute activations in the backward pass instead of keeping them from the "
        "forward (the VLA families: each layer of the vision towers and the language model, "
        "each pass of π0's action expert): activation memory per observation falls several "
        "fold (`hpcvla plan` shows it) for about one more forward. Not for policy.name=default.")
    epochs: int = setting(
        1, "Passes over each batch (PPO epochs), one optimizer step each: the first streams "
        "micro-batches as they arrive, later ones replay them. More reuse each sample more "
        "(sample efficiency) and give the critic more steps per version (see "
        "`algorithm.critic_lr`), at more learner time per version: on the default reach run "
        "8 epochs keep the learner ~99 % busy and every other role under ~10 %, 1 keeps "
        "every role busy about half the time or more. The papers' configs set 4.", ge=1)
    max_nonfinite_steps: int = setting(
        10, "Optimizer steps in a row whose gradient may be NaN/Inf (each skipped, weights "
        "and optimizer state untouched, counted in the summary) before the run stops: "
        "higher rides out rare bad batches, lower stops a diverged run sooner.", ge=1)
    checkpoint_every: int = setting(
        0, "Write a checkpoint (safetensors weights + optimizer state) every this many "
        "policy versions; 0: only at the end (and on a stop signal); -1: never (benchmarks: "
        "a full-size π0's is ~45 GB). More often loses less to a crash; what it costs the "
        "learners: `hpcvla bench checkpoint`.", ge=-1)
    checkpoint_keep: int = setting(
        2, "Newest checkpoints kept in the run directory; older ones are deleted.", ge=1)
    checkpoint_background: bool = setting(
        True, "Write checkpoints in a background thread: training waits only while each "
        "learner copies its optimizer ranges (learner 0 also the weights) to host memory, "
        "which holds that copy until the files are written (a second checkpoint due before "
        "then waits for the first). false: training waits for the files (no such copy).")
    ring_slots: int = setting(
        0, "Slots of each learner's trajectory ring, one lane per producer; a producer waits "
        "while its lane is full. 0: each lane holds its producer's share of max_staleness "
        "versions (min 32 slots; memory/layout.ring_slots). Costs slots x ring_slot_kib.", ge=0)
    ring_slot_kib: int = setting(
        1024, "Slot size in KiB; larger records are split over several slots.", ge=4)
    ring_progress: str = setting(
        "auto", "Who completes producers' writes into a learner's ring when they come from "
        "other hosts (over TCP the target's MPI does): `auto` a progress thread on the learner "
        "when its producers sit on other hosts, `thread` always, `poll` only the learner's "
        "polls (remote producers then wait out every training step). transport/progress.py.",
        choices=("auto", "thread", "poll"))
    ring_checksum: str = setting(
        "auto", "Checksum every ring slot's payload: `auto` when the learner's producers sit "
        "on other hosts (a transport fault could publish a slot before its payload lands), "
        "`always` on one host too (two extra passes over every record: about half the ring's "
        "speed for MiB records). Slot headers are checksummed either way. transport/ring.py.",
        choices=("auto", "always"))


@dataclass
class EmulateConfig:
    inference_ms: float = setting(
        0.0, "Emulated accelerator time of every forward pass on an inference rank: the pass "
        "lasts at least this long, the real (tiny) forward running inside it, a sleep "
        "padding the rest (so many 'GPUs' can be studied on a few cores). 0 = off.", ge=0)
    inference_ms_per_env: float = setting(
        0.0, "Emulated forward-pass time per env in the batch (cost = a + b x batch).", ge=0)
    learner_ms_per_micro_batch: float = setting(
        0.0, "Emulated accelerator time of every learner forward/backward (padded with a "
        "sleep like the forward pass; e.g. a deliberately slow learner). PPO/GRPO only: "
        "sac/rlpd's gradient steps are not padded.", ge=0)


@dataclass
class LaunchConfig:
    ranks: int = setting(
        4, "Ranks `hpcvla train` starts on this machine when run outside any MPI launcher "
        "(under srun/mpirun the launcher decides).", ge=1)
    mpiexec: str = setting(
        "auto", "mpiexec used when `hpcvla train`, `sft --ranks` or `eval --ranks` starts the "
        "ranks itself (`hpcvla launch` takes --mpiexec instead). `auto`: the one installed "
        "beside this Python (the MPI mpi4py runs on), else the first on PATH.")
    mpi: str = setting(
        "auto", "MPI when `hpcvla train`, `sft --ranks` or `eval --ranks` starts the ranks "
        "itself (`hpcvla launch`: --mpi): `mpich`, `openmpi` (mpi4py is pointed "
        "at its library, one-sided components `sm,ucx`; see hpcvla/process/mpi_select.py) or "
        "`auto` (the launcher beside this Python, else PATH's).",
        choices=("auto", "mpich", "openmpi"))
    check_scheduler: bool = setting(
        True, "Stop at start-up unless the MPI world size equals what Slurm (SLURM_NTASKS) "
        "or PBS (PBS_NODEFILE) allocated: a wrong PMI silently starts N one-rank worlds.")


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    emulate: EmulateConfig = field(default_factory=EmulateConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
