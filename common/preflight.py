"""Checks a service runs at its start, before it takes, waits for or loads anything.

A setting the host cannot honour (a CUDA device on a CPU host, a model folder that is not there,
an out_dir it cannot write, a metrics port another process holds) would otherwise surface one at
a time: after a model load (minutes at 27B), after the trainer has waited for a target server, or
never (a trainer waiting forever). Each service's preflight (target_server/preflight.py,
drafter_trainer/preflight.py) collects every problem it can see from the config and this host
alone into `Problems`, and raises them together as one ConfigError: one line per problem, naming
the key and the fix; `dfpipe` prints them and exits 2.

Nothing here creates anything: a folder that does not exist yet is checked for whether it could
be made (its nearest existing parent is a folder this user may write in), so a config meant for
another host is refused before it leaves folders behind.
"""
from __future__ import annotations

import json
import os
import socket
import tempfile
from collections.abc import Callable

from common.config import Config, ConfigError, default_layer_ids
from common.trust import Untrusted

BUILTIN_PREFIX = "builtin:"
# Files a tokenizer folder holds at least one of (AutoTokenizer reads either).
TOKENIZER_MARKERS = ("tokenizer.json", "tokenizer_config.json")


class UntrustedConfig(ConfigError, Untrusted):
    """Preflight problems of which one at least is a path or name another user controls: the
    service exits with EXIT_UNTRUSTED (common/exits.py), not EXIT_CONFIG, as it would at bind."""


class Problems:
    """The problems one preflight found, in the order found."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.untrusted = False   # one of them is another user's folder or file

    def add(self, problem: str | None, untrusted: bool = False) -> None:
        if problem:
            self.lines.append(problem)
            self.untrusted = self.untrusted or untrusted

    def check(self, fn: Callable[..., object], *args: object) -> bool:
        """Run a check that raises ConfigError at its first problem; keep the problem, go on. True when it passed."""
        try:
            fn(*args)
        except ConfigError as e:
            self.add(str(e))
            return False
        return True

    def raise_all(self, service: str) -> None:
        """One ConfigError holding every problem (the single one as it is), or nothing; an
        UntrustedConfig when another user controls something the service would use."""
        error = UntrustedConfig if self.untrusted else ConfigError
        if len(self.lines) == 1:
            raise error(self.lines[0])
        if self.lines:
            raise error(f"the {service} cannot start with this config ({len(self.lines)} problems):\n"
                              + "\n".join(f"  - {line}" for line in self.lines))


def model_folder_problem(path: str) -> str:
    """What keeps `path` from being a Hugging Face model folder, in words ("" when it has a config.json)."""
    if not os.path.exists(path):
        return f"no such folder {path}"
    if not os.path.isdir(path):
        return f"{path} is a file, not a model folder"
    if not os.path.isfile(os.path.join(path, "config.json")):
        return (f"{path} has no config.json (a Hugging Face model folder holds config.json, the *.safetensors "
                f"weights and the tokenizer files)")
    return ""


def weights_problem(path: str) -> str:
    """What keeps the model folder `path` (with a config.json) from holding its weights ("" when it does)."""
    if os.path.isfile(os.path.join(path, "model.safetensors.index.json")) or any(
            name.endswith(".safetensors") for name in os.listdir(path)):
        return ""
    return f"{path} has no *.safetensors weights (nor model.safetensors.index.json)"


def local_model(cfg: Config) -> str:
    """target.model resolved against the config file when it names a folder; "" for a builtin target."""
    return "" if cfg.target.model.startswith(BUILTIN_PREFIX) else cfg.resolve(cfg.target.model)


def has_tokenizer(folder: str) -> bool:
    return any(os.path.isfile(os.path.join(folder, name)) for name in TOKENIZER_MARKERS)


def tokenizer_folder(cfg: Config) -> str:
    """The target's tokenizer: target.tokenizer when set, else a local model folder that holds one;
    "" when neither (a builtin target without target.tokenizer)."""
    if cfg.target.tokenizer:
        return cfg.resolve(cfg.target.tokenizer)
    model = local_model(cfg)
    return model if model and has_tokenizer(model) else ""


def capture_layer_ids(num_layers: int, layer_ids: list[int], num_capture_layers: int) -> list[int]:
    """The target layers captured: target.layer_ids, or the DFlash default for a `num_layers`-layer
    target; ConfigError (naming the key) when they do not fit it."""
    ids = list(layer_ids) if layer_ids else default_layer_ids(num_layers, num_capture_layers)
    if any(not 0 <= i < num_layers for i in ids) or any(a >= b for a, b in zip(ids, ids[1:])):
        raise ConfigError(f"target.layer_ids {ids}: need strictly increasing ids in [0, {num_layers}) "
                          f"for this {num_layers}-layer target")
    return ids


def check_capture_layers(cfg: Config, problems: Problems) -> None:
    """target.layer_ids / num_capture_layers against a local model folder's layer count (a builtin
    target's is known once built: the server checks it then)."""
    model = local_model(cfg)
    try:
        with open(os.path.join(model, "config.json"), encoding="utf-8") as f:
            config = json.load(f)
        num_layers = int((config.get("text_config") or config)["num_hidden_layers"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return   # no local folder, or not one: check_target_folders says so
    problems.check(capture_layer_ids, num_layers, cfg.target.layer_ids, cfg.target.num_capture_layers)


def check_target_folders(cfg: Config, problems: Problems, reader: str) -> None:
    """target.model (a local folder: config.json and weights) and target.tokenizer (when set: a
    tokenizer folder). `reader` says what the service reads there, for the message."""
    if model := local_model(cfg):
        if problem := model_folder_problem(model) or weights_problem(model):
            problems.add(f"target.model: {problem} ({reader}); set target.model to the target's model folder "
                         f"(or builtin:tiny-qwen3.5 / builtin:tiny-qwen3)")
    if cfg.target.tokenizer:
        folder = cfg.resolve(cfg.target.tokenizer)
        if not os.path.isdir(folder):
            problems.add(f"target.tokenizer: no such folder {folder}; set it to the target's tokenizer folder, "
                         f"or \"\" when target.model holds the tokenizer")
        elif not has_tokenizer(folder):
            problems.add(f"target.tokenizer: {folder} has neither {' nor '.join(TOKENIZER_MARKERS)}; set it to "
                         f"the target's tokenizer folder")


def writable_folder_problem(key: str, path: str) -> str | None:
    """Why the service could not write in the folder `path` (the value of `key`), or None. A missing
    folder is fine when it could be made; nothing is made here."""
    probe = path
    while not os.path.exists(probe):          # the nearest existing parent: the one makedirs would write in
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    if not os.path.isdir(probe):
        return f"{key}: {path} cannot be a folder: {probe} is a file; set {key} to a folder this user may write in"
    try:
        # a real write, not os.access: root passes access() on read-only mounts' folders it cannot write
        with tempfile.TemporaryFile(dir=probe):
            pass
    except OSError as e:
        what = "" if probe == path else f" (it does not exist, and its parent {probe} does not take new folders)"
        return (f"{key}: cannot write in {path}{what}: {e.strerror}; set {key} to a folder this user may write "
                f"in")
    return None


def port_problem(key: str, port: int) -> str | None:
    """Why the metrics endpoint could not listen on `port` (0: off), or None. Bound as
    prometheus_client binds it (0.0.0.0, address reuse on), then let go."""
    if not port:
        return None
    if not 0 < port < 65536:
        return f"{key}: {port} is not a port (1 to 65535; 0: no metrics endpoint)"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("0.0.0.0", port))
            s.listen(1)
    except OSError as e:
        return f"{key}: port {port} cannot be listened on ({e.strerror}); set {key} to a free port, or 0 (off)"
    return None


def check_endpoint(problems: Problems, key: str, endpoint: str, allowed_uids: list[int]) -> None:
    """The endpoint `key` names can be bound: its form, and an ipc:// folder that is trusted and can
    be written in (or made)."""
    from common.channel import endpoint_problem

    problem, folder = endpoint_problem(endpoint, allowed_uids)
    problems.add(f"{key}: {problem}" if problem else None, untrusted=isinstance(problem, Untrusted))
    if folder is not None:
        problems.add(writable_folder_problem(key, folder))
