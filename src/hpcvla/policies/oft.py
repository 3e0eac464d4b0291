"""OpenVLA-OFT as published: loads OFT's checkpoint folders and runs RLinf's RL path.

Architecture (tests/fixtures/oft/README.md): a fused DINOv2 + SigLIP vision backbone
(policies/oft_vision.py; transformers modules, as timm is not installable beside this
project's CPU torch), OFT's 3-layer GELU projector, a Llama-2 (`transformers.LlamaModel` +
an untied 32064-row `lm_head`, rms_norm_eps 1e-6) that attends **bidirectionally** to every
non-padding token (OFT's fork of transformers changes only that), and the discrete action
head: the last 256 ids of the Llama-2 vocabulary (31744..31999) are action tokens, id ->
bin `clip(32000 - id - 1, 0, 254)` -> one of the 255 centres of linspace(-1, 1, 256).

RL sequence (`sequence="rlinf"`, RLinf's `implement_version: rlinf`, what `act`/`evaluate` run):
`[BOS] + patches (+ proprio token) + pads + prompt[1:] + 8 x D zero embeddings` (8 =
DECODED_CHUNK), positions `cumsum(mask) - 1`; the logits at the last prompt token ("▁") and the
first 8 x D - 1 action positions give the 8 x D action tokens (index = step x D + dim),
restricted to the 256 action ids and divided by `temperature`; sampling draws from that,
`deterministic` takes the argmax.
`predict_action_reference` is OFT's own `predict_action` instead (no padding, a STOP token
after the actions, argmax over the whole vocabulary): with bidirectional attention the two
give different logits, and published OFT evaluations use that one. `sequence="official"`
acts and scores on OFT's sequence (the STOP token appended; padding is masked, so only the
restriction to the 256 action ids differs from predict_action), for checkpoints fine-tuned
by OFT's repository.

Scoring a recorded action: each (normalized) value maps to its nearest bin centre and its
log-prob is that of the *value*, the logsumexp over the ids that decode to it. This equals
RLinf's token log-prob except for bin 254, which ids 31744 and 31745 both decode to (RLinf
scores the drawn id alone). The entropy is RLinf's, over the 256 ids. Value (RLinf's PPO
head): on the last layer's normed hidden state at the last prompt token, hidden -> 512 -> 128
-> 8 (GELU, no final bias; one value per decoded step, RLinf's `action_level`); the chunk's
value is their mean, as the pipeline's GAE works per chunk.

OFT's own LIBERO recipe (`action_head="l1"`, a folder holding `action_head--*.pt`; the
`official` sequence): its L1-regression head (oft_vision.L1ActionHead) maps the last hidden
states of each step's D action positions (the rows `_hidden` gives: OFT's
actions_hidden_states are the same, shifted by one as its logits are) to the step's normalized
actions, which `predict_action` unnormalizes. RL acts from a Gaussian around them, its std
learned per step and dim (`log_std`, an RL head, from `init_log_std`); the value head is
RLinf's, on the same row as above.

The model always decodes `DECODED_CHUNK` (8, OFT's LIBERO chunk) steps, the number of action
positions a checkpoint was trained with; the env's `chunk_len` (<= 8) first of them are the
actions, scored alone. Cameras: `image`, and `wrist_image` when the env gives it (OFT's second
image); `state`: one proprio token when the env gives it and (for a checkpoint) the folder has
a proprio projector.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from hpcvla.config.families import ACTION_HEADS as HEADS
from hpcvla.config.policy import SEQUENCES
from hpcvla.policies.backbones import backbone
from hpcvla.policies.base import real_steps_mean
from hpcvla.policies.log_std import bounded_log_std
from hpcvla.policies.vla import CAMERAS, VLAPolicy, VocabularyHead, block_mask
from hpcvla.policies.oft_vision import FusedVisionBackbone, L1ActionHead, Projector, \
    ProprioProjector, pixel_values

ACTION_BEGIN, N_BINS, LLM_VOCAB = 31744, 256, 32000  # action ids: [31744, 32000)
ACTION_ROWS = slice(ACTION_BEGIN, ACTION_BEGIN + N_BINS)
BOS, STOP = 1, 2
DECODED_CHUNK = 8

_LLAMA = dict(vocab_size=32064, rms_norm_eps=1e-6, rope_theta=10000.0,
              max_position_embeddings=2048)
SIZES = {
    # the reference fixtures' tiny model (tests/fixtures/oft): CPU tests and reach runs
    "tiny": dict(image_size=56, patch_size=14,
                 dino=dict(hidden_size=20, num_hidden_layers=3, intermediate_size=80),
                 siglip=dict(hidden_size=36, num_hidden_layers=4, intermediate_size=134),
                 llm=dict(hidden_size=16, intermediate_size=44, num_hidden_layers=3,
                          num_attention_heads=2, num_key_value_heads=2, **_LLAMA)),
    # between them, as flow's and tokens' small presets (one GPU): the same architecture,
    # 64 patches of a 64 px image
    "small": dict(image_size=64, patch_size=8,
                  dino=dict(hidden_size=128, num_hidden_layers=4, intermediate_size=512),
                  siglip=dict(hidden_size=128, num_hidden_layers=4, intermediate_size=512),
                  llm=dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=4, **_LLAMA)),
    # OpenVLA-7B: DINOv2 ViT-L/14 reg4 + SigLIP so400m/14 at 224 px, Llama-2 7B
    "full": dict(image_size=224, patch_size=14,
                 dino=dict(hidden_size=1024, num_hidden_layers=24, intermediate_size=4096),
                 siglip=dict(hidden_size=1152, num_hidden_layers=27, intermediate_size=4304),
                 llm=dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                          num_attention_heads=32, num_key_value_heads=32, **_LLAMA)),
}


def bin_centres(device=None) -> torch.Tensor:
    edges = torch.linspace(-1.0, 1.0, N_BINS, dtype=torch.float64)
    return ((edges[:-1] + edges[1:]) / 2).float().to(device)


def bins_of(actions: torch.Tensor) -> torch.Tensor:
    """Nearest bin centre (0..254) of normalized action values."""
    return ((actions.float() + 1.0) * ((N_BINS - 1) / 2) - 0.5).round().clamp(0, N_BINS - 2).long()


def column_bins(columns: torch.Tensor) -> torch.Tensor:
    """Action-id columns (id - 31744) -> bins, as OFT decodes: clip(32000 - id - 1, 0, 254)."""
    return (N_BINS - 1 - columns).clamp(0, N_BINS - 2)


def value_logprobs(logp: torch.Tensor) -> torch.Tensor:
    """Log-probs over the 256 action-id columns -> over the 255 values (bin d = column
    255 - d; columns 0 and 1 are both bin 254)."""
    flipped = logp.flip(-1)[..., :N_BINS - 1].clone()
    flipped[..., -1] = torch.logaddexp(logp[..., 0], logp[..., 1])
    return flipped


class OFTPolicy(VLAPolicy):
    """See the module docstring.

    Args (beyond the Policy ones):
        size: "tiny" | "small" | "full" (SIZES) or a resolved dict (a checkpoint's,
            oft_checkpoint.py).
        temperature: divides the action logits when sampling and scoring (RLinf's LIBERO
            configs: 1.6); deterministic acting takes the argmax.
        use_proprio: read the env's `state` as a proprio token (when the env gives one).
        unnorm_key, max_prompt_length: a published folder's processor (oft_processor.py).
        action_head: "tokens" ("" too: policy.action_head's default), or "l1" (OFT's
            L1-regression head; a folder holding its action_head--*.pt fixes it); l1 acts
            from a Gaussian around the head's output, with a learned std starting at
            exp(init_log_std).
        center_crop: < 1: every camera image, wherever the policy reads one (acting,
            scoring, evaluation), is OFT's evaluation centre crop of this area fraction
            (oft_vision.center_crop; OFT's own augmented fine-tunes: 0.9); 1: no crop.
    """

    family = "oft"
    published_tensor = "vision_backbone.featurizer.patch_embed.proj.weight"
    # our own folders: the RL heads may be fresh
    HF_KEY_MAP = (("value_head.", "rl.value_head."), ("log_std", "rl.log_std"))

    @classmethod
    def folder_problems(cls, folder, policy_cfg, env_cfg) -> list[tuple[str, str, str]]:
        """OFT's folder: its config, statistics and tokenizer, and whether the configured env
        and policy run it as it was trained (oft_recipe.check_folder)."""
        from hpcvla.policies.oft_recipe import check_folder
        return check_folder(folder, policy_cfg, env_cfg)

    @classmethod
    def env_fit_problems(cls, policy_cfg, spec_of) -> list[str]:
        """OFT's proprio projector against the env's state, when the env gives one (the
        policy reads it then)."""
        from hpcvla.policies.oft_checkpoint import proprio_dim
        from hpcvla.policies.processor import dims_problems
        folder = policy_cfg.pretrained
        trained = proprio_dim(folder)
        spec = spec_of() if trained else None
        if spec is None or not spec.state_dim:
            return []
        return dims_problems(folder, {"state_dim": trained}, spec.state_dim, spec.action_dim)

    @classmethod
    def resolved_size(cls, size: str, obs_spec: dict, vocab_size: int) -> dict | None:
        return SIZES.get(size)

    def __init__(self, obs_spec, action_dim, chunk_len, vocab_size, size="tiny",
                 logprob_granularity: str = "chunk", dtype: str = "auto",
                 temperature: float = 1.6, use_proprio: bool = True, unnorm_key: str = "",
                 max_prompt_length: int = 128, sequence: str = "rlinf",
                 action_head: str = "tokens", init_log_std: float = -0.7,
                 center_crop: float = 1.0):
        super().__init__()
        from transformers import LlamaConfig, LlamaModel

        action_head = action_head or "tokens"
        if isinstance(size, str) and size not in SIZES:
            raise ValueError(f"unknown oft size {size!r}; presets: {', '.join(SIZES)}")
        dims = copy.deepcopy(SIZES[size] if isinstance(size, str) else size)
        if "image" not in obs_spec:
            raise ValueError(f"the oft policy needs observation 'image'; got {sorted(obs_spec)}")
        if not 1 <= chunk_len <= DECODED_CHUNK:
            raise ValueError(f"the oft policy decodes {DECODED_CHUNK} steps per call: "
                             f"env.chunk_len must be 1..{DECODED_CHUNK}, got {chunk_len}")
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        if not 0 < center_crop <= 1:
            raise ValueError(f"center_crop is an area fraction in (0, 1], got {center_crop}")
        self._setup(obs_spec, action_dim, chunk_len, vocab_size, logprob_granularity, dtype,
                    dict(size=dims, logprob_granularity=logprob_granularity, dtype=dtype,
                         temperature=temperature, use_proprio=use_proprio,
                         unnorm_key=unnorm_key, max_prompt_length=max_prompt_length,
                         sequence=sequence, action_head=action_head,
                         init_log_std=init_log_std, center_crop=center_crop))
        if sequence not in SEQUENCES:
            raise ValueError(f"oft sequence {sequence!r}: expected one of {SEQUENCES}")
        if action_head not in HEADS:
            raise ValueError(f"oft action_head {action_head!r}: expected one of {HEADS}")
        if action_head == "l1" and sequence != "official":
            raise ValueError("an L1 action head reads OFT's own sequence: sequence=official")
        self.sequence, self.head = sequence, action_head
        self.temperature, self.unnorm_key = float(temperature), unnorm_key
        self.center_crop = float(center_crop)  # OFT's evaluation crop (oft_vision.center_crop)
        self.max_prompt_length = int(max_prompt_length)
        self.cameras = [k for k in CAMERAS if k in obs_spec]
        self.use_proprio = bool(use_proprio) and self.has_state
        self.n_tokens = DECODED_CHUNK * self.action_dim

        self.vision_backbone = FusedVisionBackbone(dims, self.compute_dtype)
        self.llm_config = LlamaConfig(**dims["llm"], pad_token_id=LLM_VOCAB,
                                      bos_token_id=BOS, eos_token_id=STOP)
        width = self.llm_config.hidden_size
        self.projector = Projector(self.vision_backbone.width, width)
        if self.use_proprio:
            self.proprio_projector = ProprioProjector(obs_spec["state"][0][0], width)
        self.language_model = backbone(LlamaModel, self.llm_config, self.compute_dtype)
        self.lm_head = VocabularyHead(width, self.llm_config.vocab_size, bias=False)
        if action_head == "l1":
            self.action_head = L1ActionHead(width, self.action_dim)
            self.log_std = nn.Parameter(torch.full((self.chunk_len, self.action_dim),
                                                   float(init_log_std)))
            self.imitation_fits_std = False  # OFT's L1 loss: the mean alone
        self.value_head = nn.Sequential(nn.Linear(width, 512), nn.GELU(), nn.Linear(512, 128),
                                        nn.GELU(), nn.Linear(128, DECODED_CHUNK, bias=False))
        for layer in self.value_head[:3:2]:  # RLinf's fresh init
            nn.init.kaiming_normal_(layer.weight, mode="fan_out", nonlinearity="relu")
            nn.init.zeros_(layer.bias)
        nn.init.normal_(self.value_head[4].weight, std=0.02)
        self.to(self.compute_dtype)

    def lora_models(self):
        return [self.language_model]

    # ------------------------------------------------------------------ checkpoint folders
    @classmethod
    def folder_kwargs(cls, folder) -> dict:
        """A published folder's sizes (from its tensors), whether it has a proprio projector,
        which action head and the centre crop it was trained for; an hpcvla folder's recorded
        ones."""
        from hpcvla.policies.oft_checkpoint import folder_dims, head_file, proprio_file, \
            read_config
        from hpcvla.policies.oft_recipe import trained_crop

        config = read_config(folder)
        if "hpcvla_policy" in config:
            if config["hpcvla_policy"] != cls.family:
                raise ValueError(f"{folder}: a {config['hpcvla_policy']} policy's folder, "
                                 f"not an {cls.family} one")
            kwargs = config["kwargs"]
            return {"size": kwargs["size"], "use_proprio": kwargs.get("use_proprio", True),
                    "action_head": kwargs.get("action_head", "tokens"),
                    "center_crop": kwargs.get("center_crop", 1.0)}
        return {"size": folder_dims(folder), "use_proprio": proprio_file(folder) is not None,
                "action_head": "l1" if head_file(folder) is not None else "tokens",
                "center_crop": trained_crop(folder)}

    def load_published(self, folder) -> list[str]:
        from hpcvla.policies.oft_checkpoint import load_published
        return load_published(self, folder)

    def published_tensors(self, state: dict, source) -> tuple[dict, dict]:
        from hpcvla.policies.oft_checkpoint import published_files
        return published_files(state, source)

    def make_processor(self, spec, policy_cfg):
        """The published folder's prompt/normalization; None for an hpcvla folder."""
        from hpcvla.policies.oft_checkpoint import read_config
        from hpcvla.policies.oft_processor import OFTProcessor

        folder, tokenizer_folder = policy_cfg.pretrained, policy_cfg.tokenizer
        if "hpcvla_policy" in read_config(folder):
            return None
        state_dim = self.obs_spec["state"][0][0] if self.use_proprio else 0
        return OFTProcessor.from_folder(folder, tokenizer_folder, self.unnorm_key, spec.vocab,
                                        self.action_dim, state_dim, self.max_prompt_length)

    # ------------------------------------------------------------------ the model
    def _prompt(self, obs) -> tuple[torch.Tensor, torch.Tensor]:
        """Prompt ids and mask: the processor's, or (random init) BOS + the env's ids,
        left-padded (pads first) like RLinf's (0 = padding)."""
        if "input_ids" in obs:
            return obs["input_ids"].long(), obs["prompt_mask"].bool()
        ids = obs["instruction"].long()
        real = ids != 0
        order = torch.sort(real.int(), dim=1, stable=True).indices  # pads first
        ids, real = ids.gather(1, order), real.gather(1, order)
        ones = real.new_ones(ids.shape[0], 1)
        return torch.cat([ids.new_full((ids.shape[0], 1), BOS), ids], 1), torch.cat([ones, real], 1)

    def _prefix(self, obs) -> torch.Tensor:
        """Vision (+ proprio) token embeddings (B, P, W), given pixel values or images."""
        pixels = obs.get("pixel_values")
        if pixels is None:
            pixels = pixel_values([obs[k] for k in self.cameras], self.vision_backbone.image_size,
                                  self.center_crop)
        tokens = self.projector(self.vision_backbone(pixels.to(self.device)))
        if self.use_proprio:
            state = self.proprio_projector(obs["state"].to(tokens.dtype))
            tokens = torch.cat([tokens, state[:, None]], dim=1)
        return tokens

    def _hidden(self, obs, stop: bool) -> torch.Tensor:
        """Last-layer (normed) hidden states at the last prompt token and the action
        positions but the last: (B, 1 + n_tokens - 1, W), the rows that give the tokens."""
        ids, prompt_mask = self._prompt(obs)
        prefix = self._prefix(obs)
        embed = self.language_model.embed_tokens
        B, dtype = ids.shape[0], prefix.dtype
        parts = [embed(ids[:, :1]).to(dtype), prefix, embed(ids[:, 1:]).to(dtype),
                 prefix.new_zeros(B, self.n_tokens, prefix.shape[-1])]  # placeholders: zeros
        mask = [prompt_mask[:, :1], prompt_mask.new_ones(prefix.shape[:2]), prompt_mask[:, 1:],
                prompt_mask.new_ones(B, self.n_tokens)]
        if stop:  # OFT's predict_action: a STOP token after the actions, seen by every token
            parts.append(embed(ids.new_full((B, 1), STOP)).to(dtype))
            mask.append(prompt_mask.new_ones(B, 1))
        embeds, mask = torch.cat(parts, dim=1), torch.cat(mask, dim=1).to(self.device)
        positions = mask.long().cumsum(dim=1) - 1
        everything = torch.zeros(mask.shape[1], dtype=torch.long, device=mask.device)
        hidden = self.language_model(
            inputs_embeds=embeds, position_ids=positions, use_cache=False,
            attention_mask=block_mask(mask, everything, everything, dtype)).last_hidden_state
        start = 1 + prefix.shape[1] + ids.shape[1] - 2  # the last prompt token
        return hidden[:, start:start + self.n_tokens]

    def l1_actions(self, hidden: torch.Tensor) -> torch.Tensor:
        """The L1 head's normalized actions (B, 8, D) from `_hidden`'s rows: OFT's
        actions_hidden_states are the same rows (the last prompt token's and those of the
        action positions but the last)."""
        return self.action_head(hidden, DECODED_CHUNK).float()

    def action_logits(self, obs) -> tuple[torch.Tensor, torch.Tensor]:
        """RLinf's action logits (B, n_tokens, 256) float32, before the temperature, and the
        per-step values (B, 8)."""
        hidden = self._hidden(obs, stop=self.sequence == "official")
        logits = self.lm_head(hidden, rows=ACTION_ROWS)
        return logits, self.value_head(hidden[:, 0]).float()

    @torch.no_grad()
    def predict_action_reference(self, obs) -> tuple[torch.Tensor, torch.Tensor]:
        """OFT's `predict_action` on one prompt without padding (obs `input_ids` ending in
        29871, `prompt_mask` all true): logits over the whole vocabulary (B, n_tokens, 32064)
        and the argmax's normalized actions (B, 8, D)."""
        obs = {k: v.to(self.device) for k, v in obs.items()}  # the prompt as given
        hidden = self._hidden(obs, stop=True)
        logits = self.lm_head(hidden).float()
        if self.head == "l1":  # predict_action with the action head
            return logits, self.l1_actions(hidden)
        bins = (LLM_VOCAB - 1 - logits.argmax(dim=-1)).clamp(0, N_BINS - 2)
        return logits, bin_centres(logits.device)[bins].view(-1, DECODED_CHUNK, self.action_dim)

    # ------------------------------------------------------------------ RL
    def _gaussian(self, obs):
        """The L1 head: a Gaussian around its actions (B, H, D), its std learned."""
        hidden = self._hidden(obs, stop=True)
        mean = self.l1_actions(hidden)[:, :self.chunk_len]
        value = self.value_head(hidden[:, 0]).float().mean(dim=-1)
        return torch.distributions.Normal(mean, bounded_log_std(self.log_std).exp()), value

    def imitation_loss(self, obs, actions, real):
        """The L1 head: OFT's own fine-tuning loss, the mean absolute error of its normalized
        actions over the real steps; the action tokens: their cross-entropy on the logits as
        they are (OFT's finetune.py; `temperature` is acting's, RLinf's exploration: a fit
        at it would leave the published checkpoints' logits' scale)."""
        if self.head != "l1":
            terms = self._score(self._inputs(obs), self._model_actions(actions, obs),
                                temperature=1.0)[0]
            return real_steps_mean(-terms.float(), real)
        hidden = self._hidden(self._inputs(obs), stop=True)
        H = actions.shape[1]  # up to the DECODED_CHUNK steps the head predicts
        error = self.l1_actions(hidden)[:, :H] - self._model_actions(actions, obs)
        return real_steps_mean(error.abs(), real)

    @property
    def imitation_horizon(self) -> int:
        """Every step the head decodes, as OFT's fine-tuning trains them."""
        return DECODED_CHUNK

    def _distribution(self, obs, temperature: float | None = None, steps: int | None = None):
        """Log-probs over the 256 action bins per token (B, H, D, 256) at `temperature`
        (policy.temperature unless given) for the first `steps` (the chunk unless given),
        and the value."""
        logits, values = self.action_logits(obs)
        B, H, D = logits.shape[0], steps or self.chunk_len, self.action_dim
        logits = logits.view(B, DECODED_CHUNK, D, N_BINS)[:, :H]
        temperature = self.temperature if temperature is None else temperature
        return torch.log_softmax(logits / temperature, dim=-1), values.mean(dim=-1)

    def _sample(self, obs, deterministic):
        if self.head == "l1":
            normal, value = self._gaussian(obs)
            actions = normal.mean if deterministic else normal.sample()
            return actions, normal.log_prob(actions), value, {}
        logp, value = self._distribution(obs)
        if deterministic:
            columns = logp.argmax(dim=-1)
        else:
            columns = torch.multinomial(logp.exp().reshape(-1, N_BINS), 1).view(logp.shape[:-1])
        bins = column_bins(columns)
        terms = value_logprobs(logp).gather(-1, bins[..., None]).squeeze(-1)
        return bin_centres(logp.device)[bins], terms, value, {}

    def _score(self, obs, actions, temperature: float | None = None):
        """(log-prob terms, entropy, value) of model-space `actions` (B, H, D): H of the
        decoded steps, the token head's at `temperature` (policy.temperature unless given)."""
        if self.head == "l1":
            normal, value = self._gaussian(obs)
            return normal.log_prob(actions.float()), normal.entropy(), value
        logp, value = self._distribution(obs, temperature, steps=actions.shape[1])
        terms = value_logprobs(logp).gather(-1, bins_of(actions)[..., None]).squeeze(-1)
        entropy = -(logp.exp() * logp).sum(dim=-1)
        return terms, entropy, value


__all__ = ["OFTPolicy", "SEQUENCES", "HEADS", "SIZES", "DECODED_CHUNK", "bin_centres", "bins_of",
           "column_bins", "value_logprobs"]
