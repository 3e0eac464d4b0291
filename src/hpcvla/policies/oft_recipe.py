"""What an OpenVLA-OFT folder was trained for (its action chunk, cameras, proprio token, action
head, image crop), told by its files and names, and whether a config runs it so: checked before
any rank starts (config problems naming the setting and the fix). Reading the folder's tensors
and files: policies/oft_checkpoint.py."""

from __future__ import annotations

from pathlib import Path

from hpcvla.policies.oft_checkpoint import (folder_dims, head_file, load_tokenizer, proprio_file,
                                            read_config, read_statistics)

# OFT's action chunk per platform (its prismatic/vla/constants.py), told by the dataset key
PLATFORM_CHUNKS = {"aloha": 25, "bridge": 5, "libero": 8}


def recipe_problems(folder, config: dict, key: str, cameras: int, state: bool,
                    sequence: str) -> list[str]:
    """What of an OFT folder's recipe the `oft` policy (action tokens or OFT's L1 head, a
    chunk of 8) cannot run as trained; `cameras`: the env's images (1, 2 with the wrist);
    `state`: whether the env gives one; `sequence`: policy.sequence."""
    problems, projector = [], proprio_file(folder)
    if projector is not None and state and sequence == "rlinf":
        problems.append("its proprio projector is OFT's, read in OFT's own sequence; RLinf's "
                        "has no proprio token: set policy.sequence=official (or env.state="
                        "false to act without the state)")
    if projector is not None and not state and sequence == "official":
        problems.append(f"its proprio projector ({projector.name}) says it was fine-tuned "
                        "with the proprio token, which OFT's sequence then reads: set "
                        "env.state=true (LIBERO: env.state_format=axis_angle)")
    film = sorted(p.name for p in Path(folder).glob("vision_backbone--*.pt"))
    if film:
        problems.append(f"it was fine-tuned with FiLM (OFT's use_film: the language-modulated "
                        f"vision backbone saved apart, {film[0]}), which this policy does not "
                        "run")
    diffusion = sorted(p.name for p in Path(folder).glob("noisy_action_projector--*.pt"))
    if diffusion:
        problems.append(f"it was fine-tuned with OFT's diffusion action head ({diffusion[0]}), "
                        "which this policy does not run (it runs the action tokens of "
                        "`lm_head` and OFT's L1-regression head). Use a checkpoint fine-tuned "
                        "with either")
    elif head_file(folder) is not None and sequence != "official":
        problems.append(f"its L1-regression action head ({head_file(folder).name}, OFT's own "
                        "LIBERO recipe) reads OFT's own sequence: set policy.sequence=official")
    chunk = next((n for name, n in PLATFORM_CHUNKS.items() if name in key.lower()), 8)
    if chunk != 8:
        problems.append(f"its statistics are {key!r}, a platform whose OFT chunk is {chunk} "
                        "steps; the oft policy decodes OFT's LIBERO chunk of 8")
    images = config.get("num_images_in_input")
    if images is not None and images != cameras:
        problems.append(f"it reads {images} image(s) per step (config.json "
                        f"num_images_in_input), the env gives {cameras}: set env.wrist_image="
                        f"{'true' if images == 2 else 'false'}")
    return problems


def augmented_name(folder) -> bool:
    """Whether the folder's name, or its target's, says OFT fine-tuned it on random crops
    (OFT's run ids end in `--image_aug`)."""
    return "--image_aug" in Path(folder).name + Path(folder).resolve().name


def trained_crop(folder) -> float:
    """The centre crop (an area fraction) a published OFT folder acts on where
    policy.center_crop leaves it to the folder: OFT's 0.9 for a fine-tune on random crops,
    which its name says or its L1 action head implies (OFT's recipe: finetune.py trains with
    `image_aug` unless told not to, its LIBERO checkpoints were, and its evaluation crops by
    default); 1, none, for a token-head folder (RLinf's LIBERO checkpoints crop nothing)."""
    return 0.9 if augmented_name(folder) or head_file(folder) is not None else 1.0


def check_folder(folder, policy, env) -> list[tuple[str, str, str]]:
    """What an OFT folder lacks besides its weights, or holds that the policy cannot run
    (recipe_problems), as config problems, before any rank starts (`policy`, `env`: the
    config's sections)."""
    folder, problems = Path(folder), []
    tokenizer_folder, unnorm_key = policy.tokenizer, policy.unnorm_key
    try:
        config = read_config(folder)
        folder_dims(folder)  # the sizes the ranks build it at, from the tensors' headers
        key = read_statistics(folder, unnorm_key)[0]
        problems += [("policy.pretrained", str(folder), f"an OpenVLA-OFT folder the oft "
                      f"policy runs as trained: {why}")
                     for why in recipe_problems(folder, config, key, 1 + env.wrist_image,
                                                env.state, policy.sequence)]
        if augmented_name(folder) and policy.center_crop >= 1:  # 0: the folder's, 0.9
            problems.append(("policy.center_crop", policy.center_crop, f"0.9 (or 0: the "
                             f"folder's): {folder} was fine-tuned on OFT's random 90 % crops "
                             "(its name says image_aug)"))
    except (ValueError, OSError) as err:
        field = "policy.unnorm_key" if "unnorm_key" in str(err) else "policy.pretrained"
        problems.append((field, str(folder) if field == "policy.pretrained" else unnorm_key,
                         f"an OpenVLA-OFT folder: {err}"))
    tokenizer = Path(tokenizer_folder or folder)
    field = "policy.tokenizer" if tokenizer_folder else "policy.pretrained"
    if not any((tokenizer / f).is_file() for f in ("tokenizer.json", "tokenizer.model")):
        problems.append((field, str(tokenizer), "a folder holding the checkpoint's Llama "
                         "tokenizer (tokenizer.json or tokenizer.model; OFT checkpoints ship "
                         "it)"))
        return problems
    try:  # what the ranks will load (~1 s), loaded once here
        load_tokenizer(tokenizer)
    except ValueError as err:
        problems.append((field, str(tokenizer), str(err).split(": ", 1)[-1]))
    return problems


__all__ = ["PLATFORM_CHUNKS", "augmented_name", "check_folder", "recipe_problems", "trained_crop"]
