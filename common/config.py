"""One config object for both services, loaded from YAML with strict checking.

Every knob lives here with its default. Both services read the same file: the target server uses
`ring`, `data`, `target`, `service`, `cluster`; the trainer uses `drafter`, `train`, `service`,
`cluster` and learns the target's shape from the server's WELCOME. Unknown keys and wrong types
are errors, not warnings: a typo in a hyper-parameter must not silently train with the default.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import typing
from dataclasses import dataclass, field
from typing import Any

import yaml

# the wire's bounds: a config the protocol cannot carry is refused at load, naming its key
from common.protocol import MAX_EPOCHS, MAX_HELDOUT, MAX_WORKERS
from common.ring_limits import MAX_SLOT_SIZE, MAX_SLOTS
from common.trust import private_dir


class ConfigError(ValueError):
    """A config file or override that cannot be used; the message names the key."""


@dataclass
class RingConfig:
    name: str = ""                      # ring files: <shm_dir>/<name>.w<worker>.<producer_epoch>; "": the run's
                                        # own, dfpipe-<run_tag(train.out_dir)> (Config.__post_init__)
    shm_dir: str = "/dev/shm"
    slots: int = 6                      # slots per target worker
    cuda_register: str = "auto"         # auto | off | require


@dataclass
class DataConfig:
    train_path: str = ""                # a prepared shard folder, or a chat .jsonl prepared on start
    heldout_path: str = ""              # held-out data (folder or chat .jsonl) for eval during training
    seed: int = 0
    token_budget: int = 4096            # tokens per packed batch (one fixed shape)
    max_len: int = 3072                 # longest sample kept as one document
    overlong: str = "truncate"          # truncate | split | skip
    # A larger row (JSONL line, Parquet row) is a bad row, refused unparsed: above any conversation a 262K-token
    # context holds (~1 MiB of text, ~6 MiB as \u-escaped JSON), yet a row tokenized whole (overlong: split)
    # stays within a few GB of memory (README "Your data").
    max_row_bytes: int = 16 << 20
    # More bad rows than this share of a file's rows stops preparation (exit status 2): a file mostly
    # bad is the wrong file or a broken export. 1: train on whatever rows are good.
    max_bad_share: float = 0.5
    format: str = "auto"                # chat rows: auto (per file) | openai (messages) | sharegpt (conversations)
    chat_template: str = ""             # Jinja file or inline text rendering the rows; "": the tokenizer's own
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)  # template variables: enable_thinking: false


@dataclass
class TargetConfig:
    model: str = "builtin:tiny-qwen3.5"  # a local HF folder, or builtin:<name>
    tokenizer: str = ""                 # tokenizer folder when the model folder has none (builtin targets)
    cache_dir: str = ".cache/dfpipe"    # built-in targets and prepared data land here
    layer_ids: list[int] = field(default_factory=list)  # empty: default_layer_ids(L, num_capture_layers)
    num_capture_layers: int = 5
    devices: list[str] = field(default_factory=lambda: ["cpu"])  # one worker per device
    dtype: str = "auto"                 # auto: bf16 on cuda, fp32 on cpu
    warmup: bool = True
    triton_cache_dir: str = ""          # persisted across restarts so autotune runs once
    audit_every: int = 50               # recompute one document unpacked every N batches (0: off)
    audit_tolerance: float = 0.05
    max_hidden_norm: float = 1.0e4      # a captured row with a larger RMS is quarantined


@dataclass
class DrafterConfig:
    num_layers: int = 5
    block_size: int = 16
    mask_token_id: int = -1             # -1: from the tokenizer's mask token
    max_anchors: int = 512              # anchors per document (the DFlash recipe's cap), not per batch
    blocks_per_chunk: int = 0           # blocks per forward+backward chunk of a step; 0: auto (12,288 block tokens)
    gamma: float = 0.0                  # 0: 7 for B=16, 5 for B=10, 4 for B=8
    sliding_window: int = 0             # 0: all layers full attention
    layer_types: list[str] = field(default_factory=list)  # empty: all full_attention
    split_fc: bool = False
    attn: str = "auto"                  # split | sdpa | flex | flash | fa4; auto: split on CPU; on CUDA fa4 (SM90, FA4 installed, compiled), else flash, else flex
    compile: str = "auto"               # on | off: torch.compile the layers, norms and loss; auto: on for CUDA
    precision: str = "bf16"             # matmuls: bf16 | fp8 (scaled e4m3, Ada/Hopper) | fp8-emulated | auto (fp8 where it runs)
    loss_chunk: int = 1024              # anchor-block rows per lm_head chunk
    intermediate_size: int = 0          # 0: the target's
    num_heads: int = 0                  # 0: the target's attention heads
    num_kv_heads: int = 0
    head_dim: int = 0


@dataclass
class TrainConfig:
    out_dir: str = "runs/dfpipe"
    epochs: int = 6
    lr: float = 6e-4
    min_lr_ratio: float = 0.0
    warmup_ratio: float = 0.04
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    grad_clip: float = 1.0
    checkpoint_every: int = 200         # steps
    keep_checkpoints: int = 3
    max_bad_steps: int = 8              # consecutive non-finite steps before checkpoint-and-stop
    max_checkpoint_failures: int = 3    # consecutive failed checkpoints (full disk...) before stopping
    eval_every: int = 0                 # steps between held-out evals; 0: off (needs data.heldout_path)
    eval_batches: int = 4               # held-out packed batches the target server serves per session
    log_every: int = 10
    seed: int = 0
    device: str = "auto"                # auto: cuda:<local_rank> if CUDA, else cpu
    devices: list[str] = field(default_factory=list)  # placement: rank r (LOCAL_RANK) runs on devices[r]
    compute_dtype: str = "auto"         # auto: bf16 on cuda, fp32 on cpu
    max_steps: int = 0                  # 0: until the epochs end
    tensorboard: bool = True
    wandb_project: str = ""
    new_plan: bool = False              # resume the weights under a changed data plan, accounting anew


MAX_LR = 1.0   # train.lr's bound (validate)

RUN_TAG_NAME_CHARS = 16   # of the run folder's name in a run tag; with the hash, short enough for a socket path


def run_tag(out_dir: str) -> str:
    """The short name of a run: its folder's name (up to RUN_TAG_NAME_CHARS characters, letters,
    digits, '.', '_', '-') and 8 hex digits of its absolute path, e.g. `demo-3f0c9a1e`. Two runs of
    one user on one host have two out_dirs, hence two tags: the default ring name and endpoints are
    made of it, so two clones or two configs never meet unless their configs name the same ones."""
    path = os.path.abspath(out_dir)
    name = re.sub(r"[^A-Za-z0-9._-]", "_", os.path.basename(path))[:RUN_TAG_NAME_CHARS].strip("._-") or "run"
    return f"{name}-{hashlib.sha256(path.encode()).hexdigest()[:8]}"


def _private_endpoint(tag: str, service: str) -> str:
    """ipc://<this user's private folder>/<run tag>-<service>.sock (common.trust.private_dir)."""
    return f"ipc://{private_dir()}/{tag}-{service}.sock"


@dataclass
class ServiceConfig:
    # "": the run's own, in this user's private folder ($XDG_RUNTIME_DIR/dfpipe or /tmp/dfpipe-<uid>,
    # made 0700): <run_tag(train.out_dir)>-target.sock, -trainer.sock (Config.__post_init__)
    target_endpoint: str = ""
    trainer_endpoint: str = ""
    allowed_uids: list[int] = field(default_factory=list)  # ipc peers trusted besides this user and root
    heartbeat_s: float = 1.0            # PING period
    lease_s: float = 10.0               # no PONG for this long: the peer is presumed hung
    rescan_s: float = 0.5               # header re-scan period (ZeroMQ is only the doorbell)
    request_timeout_s: float = 5.0
    target_metrics_port: int = 0        # 0: no Prometheus endpoint
    trainer_metrics_port: int = 0
    max_message_bytes: int = 1 << 20
    curve_server_key: str = ""          # ZeroMQ CURVE certificates (`dfpipe keys`): needed for a tcp://
    curve_client_key: str = ""          # endpoint outside loopback; set both or neither


@dataclass
class ClusterConfig:
    num_hosts: int = 1                  # hosts in the torchrun world, each with its own target server
    host_rank: int = 0                  # this host's shard of every epoch; set per host (--set, DFPIPE_HOST_RANK
                                        # in the deployment files): torchrun's node rank is not promised to match


@dataclass
class Config:
    ring: RingConfig = field(default_factory=RingConfig)
    data: DataConfig = field(default_factory=DataConfig)
    target: TargetConfig = field(default_factory=TargetConfig)
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    service: ServiceConfig = field(default_factory=ServiceConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    source: str = ""                    # the file it came from; relative paths resolve against it

    def __post_init__(self) -> None:
        """Names left empty become the run's own (`run_tag` of the resolved train.out_dir): both
        services read the same file, so both derive the same ring and endpoints."""
        tag = run_tag(self.resolve(self.train.out_dir))
        self.ring.name = self.ring.name or f"dfpipe-{tag}"
        self.service.target_endpoint = self.service.target_endpoint or _private_endpoint(tag, "target")
        self.service.trainer_endpoint = self.service.trainer_endpoint or _private_endpoint(tag, "trainer")

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.pop("source")
        return d

    def hash(self, *sections: str) -> str:
        """Stable digest of the named sections (all when none): what a checkpoint was trained with."""
        d = self.to_dict()
        if sections:
            d = {k: d[k] for k in sections}
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]

    def resolve(self, path: str) -> str:
        """A path from the config, relative to the config file's folder."""
        if not path or os.path.isabs(path) or path.startswith("builtin:") or not self.source:
            return path
        return os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(self.source)), path))


def _check_json(value: Any, key: str) -> None:
    """A value that JSON carries unchanged (it is hashed and recorded); YAML can also give dates, sets..."""
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                raise ConfigError(f"{key}: keys must be strings, got {k!r}")
            _check_json(v, f"{key}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _check_json(v, f"{key}[{i}]")
    elif value is not None and not isinstance(value, (str, int, float, bool)):
        raise ConfigError(f"{key}: expected a string, number, boolean, list or mapping, got {type(value).__name__}")


def _check_type(value: Any, tp: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    if origin is dict:  # dict[str, Any]: a mapping of str keys to JSON values; an empty YAML key is {}
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {type(value).__name__} ({value!r})")
        _check_json(value, key)
        return dict(value)
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {type(value).__name__}")
        return [_check_type(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value)]
    if tp is str and isinstance(value, bool):
        # YAML 1.1 reads a bare `off` / `on` as a boolean; for string knobs (cuda_register: off) that is
        # what the user wrote, so take it back.
        return "on" if value else "off"
    if tp is float and isinstance(value, str):
        try:  # YAML 1.1 reads `3e-4` (no dot) as a string
            return float(value)
        except ValueError:
            raise ConfigError(f"{key}: expected float, got {value!r}") from None
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp in (int, float, str, bool):
        if type(value) is not tp:
            raise ConfigError(f"{key}: expected {tp.__name__}, got {type(value).__name__} ({value!r})")
        return value
    raise ConfigError(f"{key}: unsupported type {tp}")


# Keys an older config may still hold, and why they went.
REMOVED_KEYS = {
    "drafter.warm_up": "a compiling trainer always takes its first steps eagerly while its kernels compile "
                       "in the background (compiling before the first step took twice as long to it)",
}


def _fill(cls: type, data: dict[str, Any], prefix: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix or 'config'}: expected a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    for key in (prefix + k for k in unknown):
        if key in REMOVED_KEYS:
            raise ConfigError(f"{key} no longer exists: {REMOVED_KEYS[key]}; delete it from the config")
    if unknown:
        raise ConfigError(f"unknown key(s) {', '.join(prefix + k for k in unknown)}")
    kwargs = {}
    for name, value in data.items():
        tp = hints[name]
        if dataclasses.is_dataclass(tp):
            kwargs[name] = _fill(tp, value or {}, f"{prefix}{name}.")
        else:
            kwargs[name] = _check_type(value, tp, prefix + name)
    return cls(**kwargs)


def _parse_override(item: str) -> tuple[list[str], Any]:
    if "=" not in item:
        raise ConfigError(f"override {item!r}: expected section.key=value")
    key, raw = item.split("=", 1)
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError as e:
        problem = " ".join(str(getattr(e, "problem", "") or e).split())
        raise ConfigError(f"--set {key.strip()}: the value {raw!r} is not YAML ({problem}); quote a string "
                          f"value, e.g. --set '{key.strip()}=\"...\"'") from None
    return key.strip().split("."), value


def validate(cfg: Config) -> Config:
    """Cross-field checks that a type check cannot express."""
    def need(cond: bool, msg: str) -> None:
        if not cond:
            raise ConfigError(msg)

    need(2 <= cfg.ring.slots <= MAX_SLOTS, f"ring.slots: 2 to {MAX_SLOTS} slots per worker")
    need(cfg.ring.cuda_register in ("auto", "off", "require"), "ring.cuda_register: auto | off | require")
    need(bool(cfg.ring.name) and "/" not in cfg.ring.name, "ring.name: a non-empty name without '/'")
    need(cfg.data.token_budget >= 16, "data.token_budget: at least 16 tokens")
    # A slot holds the batch's hidden planes and at least 4 bytes per token beside them; the exact
    # size needs the target's width (`target_server.worker.TargetWorker.slot_size` checks it again).
    need(cfg.data.token_budget * 4 <= MAX_SLOT_SIZE,
         f"data.token_budget: {cfg.data.token_budget} tokens need a ring slot larger than the ring's limit "
         f"({MAX_SLOT_SIZE} bytes)")
    need(cfg.data.max_row_bytes >= 1, f"data.max_row_bytes: at least 1 byte (got {cfg.data.max_row_bytes})")
    need(0 <= cfg.data.max_bad_share <= 1,
         f"data.max_bad_share: a share of the rows from 0 to 1 (got {cfg.data.max_bad_share}; 1 allows any)")
    need(cfg.data.max_len >= 2, "data.max_len: at least 2 tokens")
    need(cfg.data.max_len <= cfg.data.token_budget,
         f"data.max_len ({cfg.data.max_len}) must not exceed data.token_budget ({cfg.data.token_budget}): "
         f"a document is trained whole, in one batch. Raise data.token_budget to at least {cfg.data.max_len}, "
         "or lower data.max_len (longer documents are then cut or skipped by data.overlong)")
    need(cfg.data.overlong in ("truncate", "split", "skip"), "data.overlong: truncate | split | skip")
    need(cfg.data.format in ("auto", "openai", "sharegpt"), "data.format: auto | openai | sharegpt")
    need(cfg.target.num_capture_layers >= 1, "target.num_capture_layers: at least 1")
    need(1 <= len(cfg.target.devices) <= MAX_WORKERS, f"target.devices: 1 to {MAX_WORKERS} devices (one worker each)")
    gpus = [d for d in cfg.train.devices if d != "cpu"]
    need(len(set(gpus)) == len(gpus), "train.devices: each GPU once (one rank per GPU; \"cpu\" may repeat)")
    need(cfg.target.dtype in ("auto", "bf16", "fp32", "fp16"), "target.dtype: auto | bf16 | fp16 | fp32")
    need(cfg.train.compute_dtype in ("auto", "bf16", "fp32"), "train.compute_dtype: auto | bf16 | fp32")
    need(cfg.drafter.block_size >= 2, "drafter.block_size: at least 2")
    need(cfg.drafter.num_layers >= 1, "drafter.num_layers: at least 1")
    need(cfg.drafter.max_anchors >= 1, "drafter.max_anchors: at least 1 (anchors per document)")
    need(cfg.drafter.blocks_per_chunk >= 0, "drafter.blocks_per_chunk: 0 (auto) or a positive number of blocks")
    for t in cfg.drafter.layer_types:
        need(t in ("full_attention", "sliding_attention"), f"drafter.layer_types: unknown type {t!r}")
    need(cfg.drafter.attn in ("auto", "split", "sdpa", "flex", "flash", "fa4"),
         "drafter.attn: auto | split | sdpa | flex | flash | fa4")
    need(cfg.drafter.compile in ("auto", "off", "on"), "drafter.compile: auto | off | on")
    need(cfg.drafter.precision in ("auto", "bf16", "fp8", "fp8-emulated"),
         "drafter.precision: auto | bf16 | fp8 | fp8-emulated")
    need(not cfg.drafter.layer_types or len(cfg.drafter.layer_types) == cfg.drafter.num_layers,
         "drafter.layer_types: one entry per drafter layer")
    need("sliding_attention" not in cfg.drafter.layer_types or cfg.drafter.sliding_window > 0,
         "drafter.sliding_window: required when a layer is sliding_attention")
    # A block's last token sits block_size - 1 positions after its anchor: a narrower window would
    # hide the anchor (the one real token of the block) from it.
    need(cfg.drafter.sliding_window == 0 or cfg.drafter.sliding_window >= cfg.drafter.block_size,
         f"drafter.sliding_window ({cfg.drafter.sliding_window}) is smaller than drafter.block_size "
         f"({cfg.drafter.block_size}): a block's last tokens could not see its anchor; set "
         f"drafter.sliding_window to at least {cfg.drafter.block_size} (or 0: no sliding window)")
    need(1 <= cfg.train.epochs <= MAX_EPOCHS, f"train.epochs: 1 to {MAX_EPOCHS} (the protocol's plan of a run)")
    # AdamW moves each weight by about lr per step whatever the gradient's size: above 1 the first
    # steps throw the weights out of range (1e38 overflows to inf/nan). The recipe's is 6e-4.
    need(0 < cfg.train.lr <= MAX_LR, f"train.lr: above 0 and at most {MAX_LR:g} (got {cfg.train.lr:g}; "
         f"the recipe's is {TrainConfig.lr:g})")
    need(0 <= cfg.train.warmup_ratio < 1, "train.warmup_ratio: in [0, 1)")
    need(len(cfg.train.betas) == 2, "train.betas: two numbers")
    need(cfg.train.checkpoint_every >= 1, "train.checkpoint_every: at least 1 step")
    need(cfg.train.keep_checkpoints >= 1, "train.keep_checkpoints: at least 1")
    need(cfg.train.max_checkpoint_failures >= 1, "train.max_checkpoint_failures: at least 1")
    need(cfg.train.eval_every >= 0, "train.eval_every: 0 (off) or a positive number of steps")
    need(1 <= cfg.train.eval_batches <= MAX_HELDOUT, f"train.eval_batches: 1 to {MAX_HELDOUT}")
    need(cfg.train.eval_every == 0 or bool(cfg.data.heldout_path),
         f"train.eval_every ({cfg.train.eval_every}) needs data.heldout_path: held-out batches come from "
         "the target server (set data.heldout_path, or train.eval_every: 0)")
    need(not cfg.data.heldout_path or cfg.resolve(cfg.data.heldout_path) != cfg.resolve(cfg.data.train_path),
         "data.heldout_path: must not be data.train_path (held-out rows are never training rows)")
    need(cfg.service.lease_s > cfg.service.heartbeat_s > 0, "service: need lease_s > heartbeat_s > 0")
    need(all(0 <= uid < 2 ** 32 - 1 for uid in cfg.service.allowed_uids),
         "service.allowed_uids: user ids (numbers from 0), e.g. [1001]")
    need(bool(cfg.service.curve_server_key) == bool(cfg.service.curve_client_key),
         "service.curve_server_key and service.curve_client_key: set both or neither (`dfpipe keys --out DIR`)")
    need(cfg.cluster.num_hosts >= 1, f"cluster.num_hosts: at least 1 (got {cfg.cluster.num_hosts})")
    need(0 <= cfg.cluster.host_rank < cfg.cluster.num_hosts,
         f"cluster.host_rank: {cfg.cluster.host_rank} is not a host of cluster.num_hosts "
         f"{cfg.cluster.num_hosts} (0 to {cfg.cluster.num_hosts - 1}; set it per host)")
    return cfg


# What differs from host to host when one config file serves them all: environment variable -> key.
# Applied over the file and under --set (the deployment files set them per host).
ENV_OVERRIDES = {"DFPIPE_NUM_HOSTS": "cluster.num_hosts", "DFPIPE_HOST_RANK": "cluster.host_rank"}


def env_overrides(environ: typing.Mapping[str, str] | None = None) -> list[str]:
    """The `section.key=value` overrides the environment sets (an empty variable sets nothing)."""
    environ = os.environ if environ is None else environ
    return [f"{key}={environ[var].strip()}" for var, key in ENV_OVERRIDES.items() if environ.get(var, "").strip()]


def load_config(path: str | None = None, overrides: list[str] | None = None) -> Config:
    """Read YAML (or defaults when path is None), apply the environment's overrides (ENV_OVERRIDES),
    then the `section.key=value` overrides, validate."""
    data: dict[str, Any] = {}
    if path:
        try:
            with open(path, encoding="utf-8") as f:
                data = yaml.safe_load(f) or {}
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {path}") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML: {e}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: expected a mapping at the top level")
    for item in [*env_overrides(), *(overrides or [])]:
        keys, value = _parse_override(item)
        node = data
        for k in keys[:-1]:
            node = node.setdefault(k, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: {k} is not a section")
        node[keys[-1]] = value
    # the source goes in with the rest: the names derived from train.out_dir resolve it against the file
    cfg = _fill(Config, {**{k: v for k, v in data.items() if k != "source"},
                         "source": os.path.abspath(path) if path else ""}, "")
    return validate(cfg)


def default_layer_ids(num_layers: int, k: int) -> list[int]:
    """DFlash capture layers: round(1 + i*(L-4)/(k-1)), e.g. [1,16,31,46,61] for L=64, k=5; one layer
    is the middle one, L // 2 (the published rule)."""
    if k == 1:
        return [num_layers // 2]
    ids = [int(round(1 + i * (num_layers - 4) / (k - 1))) for i in range(k)]
    if len(set(ids)) != k or ids[-1] >= num_layers:
        most = next(j for j in range(k - 1, 0, -1) if _places(num_layers, j))
        raise ConfigError(f"cannot place {k} capture layers in a {num_layers}-layer target: set "
                          f"target.num_capture_layers to at most {most}, or list the layers in target.layer_ids")
    return ids


def _places(num_layers: int, k: int) -> bool:
    """Whether `default_layer_ids` spreads k layers over the target (k = 1 always fits)."""
    try:
        default_layer_ids(num_layers, k)
    except ConfigError:
        return False
    return True


def check_devices(key: str, devices: str | list[str]) -> None:
    """The devices a service is about to use, checked at its start (not at load: ctl, inspect and
    the tests read GPU configs on hosts without a GPU): each names a CPU or a CUDA device this host
    has. A CUDA device where torch finds none would otherwise fail deep inside torch (a missing
    `_cuda_setDevice`, a pin_memory error) or, as `train.device: cuda`, quietly run on the CPU."""
    import torch

    listed = isinstance(devices, list)
    shown, cpu = (f"[{', '.join(devices)}]", "[cpu]") if listed else (devices, "cpu")
    for value in devices if listed else [devices]:
        if value == "auto" and not listed:
            continue
        try:
            device = torch.device(value)
        except (RuntimeError, TypeError):
            raise ConfigError(f"{key}: {value!r} is not a device (cpu, cuda or cuda:N)") from None
        if device.type not in ("cpu", "cuda"):
            raise ConfigError(f"{key}: {value!r}: dfpipe runs on cpu or cuda devices")
        if device.type != "cuda":
            continue
        if not torch.cuda.is_available():
            raise ConfigError(f"{key}: {shown} asks for CUDA, but torch finds no CUDA device on this host "
                              f"(torch.cuda.is_available() is False): set {key}: {cpu}")
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise ConfigError(f"{key}: {value} is not on this host, which has {count} CUDA device(s) "
                              f"(cuda:0 to cuda:{count - 1}; CUDA_VISIBLE_DEVICES renumbers them)")


def default_gamma(block_size: int) -> float:
    """Loss decay per block position: 7 for B=16, 5 for B=10, 4 for B=8 (published recipe)."""
    return {16: 7.0, 10: 5.0, 8: 4.0}.get(block_size, max(1.0, block_size * 7.0 / 16.0))
