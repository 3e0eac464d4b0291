"""Every setting hpcvla reads, with what it does and what it trades off.

A section is a dataclass; a setting is a field declared with `setting(...)`, whose `doc` says
what the value means and what raising or lowering it costs (the style of Sample Factory's
flags). `hpcvla config --doc` prints every setting's documentation, one block per setting.
Sections of their own: config/policy.py, env.py, learning.py (algorithm), evaluation.py,
imitation.py.

Fields are checked by `hpcvla.config.loader`: types from the annotations, `choices`, and the
numeric bounds `ge`/`le`; then the checks that involve several fields (config/checks.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hpcvla.config.env import EnvConfig
from hpcvla.config.evaluation import EvalConfig
from hpcvla.config.imitation import SFTConfig
from hpcvla.config.learning import AlgorithmConfig, setting
from hpcvla.config.policy import PolicyConfig
from hpcvla.schedule import MODES


ROLES = ("simulator", "inference", "learner")
PLACEMENT_MODES = ("colocated", "disaggregated", "hybrid")
RING_PROGRESS = ("auto", "thread", "poll")  # transport/progress.py
RING_CHECKSUMS = ("auto", "always")  # transport/slots.py
MPI_FLAVOURS = ("auto", "mpich", "openmpi")  # process/mpi_select.py


@dataclass
class RunConfig:
    name: str = setting(
        "default", "Run name; the run directory is `<root>/<name>-<timestamp>` "
        "(`<name>-sft-<timestamp>` for `hpcvla sft`): not empty, no '/', no leading '-'.")
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
    dump_max_gib: float = setting(
        0.0, "With run.dump_trajectories: at most this many GiB for the run's trajectory dumps "
        "together. Each producer (an inference rank; each rank when colocated) may fill an "
        "equal share of it, less what the files of ranks that produce no more hold (a restart "
        "on fewer nodes, a resume on another layout): a file that reaches its share "
        "takes no more episodes (it may pass it by one flush's, run.dump_flush_s of them, at "
        "most 512), its producer says so once, and it counts those it did not write "
        "(`episodes_not_written`, `hpcvla inspect`); the run goes on. A resumed run under a "
        "larger value writes on. 0: no limit (a long run's dumps can fill the disk, and the "
        "run then stops, naming the file).", ge=0)
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
        choices=["disabled", "offline", "online"],
        known_as={word: "disabled" for word in ("off", "no", "false", "none")})
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
        "than the slowest segment takes. With env.isolation=process and env.max_restarts > 0 "
        "a learner waits env.step_timeout_s more (a hung worker is found only then), and a "
        "restarted worker's build and first segments must fit in this. Inference ranks "
        "held this long (staleness quota, full ring lane) name their learner, learners "
        "this long in a version say so, each time, and wait on (a version may take that "
        "long; one that hangs says nothing); so does every rank this long in its start-up, "
        "its teardown or the report, a sync-colocated rank in a version, an `hpcvla sft` "
        "learner in its start-up, a step or its end, and an `hpcvla eval` rank waiting for "
        "the others.", ge=1)


@dataclass
class RolloutConfig:
    segment_len: int = setting(
        8, "Chunk-steps per trajectory segment sent to a learner (bootstrapped with the "
        "value of the next observation). Longer: better advantages, later delivery.", ge=1)
    batch_max: int = setting(
        0, "B_max of the dynamic batcher, in envs: a forward pass fires once this many "
        "envs wait (0 = all envs of the cell; at most those). Larger batches use the "
        "accelerator better; smaller ones answer sooner.", ge=0)
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
        "policy versions; 0: none by versions (learner.checkpoint_every_s's by the clock, and "
        "at the end and on a stop signal); -1: never (benchmarks: "
        "a full-size π0's is ~45 GB). More often loses less to a crash; what it costs the "
        "learners: `hpcvla bench checkpoint`. learner.checkpoint_every_s writes them by the "
        "clock as well.", ge=-1)
    checkpoint_every_s: float = setting(
        3600.0, "Also write a checkpoint at the end of the first version this many seconds "
        "after the last one (or this start), on the first learner's clock: a job of a day "
        "whose versions take minutes keeps its work though learner.checkpoint_every counts "
        "none (a node's failure, or a restart, then loses at most this long). 0: by "
        "versions only; learner.checkpoint_every=-1 writes none either way.", ge=0)
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
        choices=RING_PROGRESS)
    ring_checksum: str = setting(
        "auto", "Checksum every ring slot's payload: `auto` when the learner's producers sit "
        "on other hosts (a transport fault could publish a slot before its payload lands), "
        "`always` on one host too (two extra passes over every record: about half the ring's "
        "speed for MiB records). Slot headers are checksummed either way. transport/ring.py.",
        choices=RING_CHECKSUMS)


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
        choices=MPI_FLAVOURS)
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
