"""Where the Hydra configs live, composing one as the console scripts do, and the resolvers they name."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf, open_dict

from aiayn.config.naming import experiment_name, job_dir, multirun_dir, output_root, run_dir, sweep_dir
from aiayn.machine import cpu_precision


def config_dir() -> str:
    """``aiayn/conf`` inside an installed wheel, else the repository's top-level ``conf/``."""
    package = Path(__file__).resolve().parents[1]  # aiayn/
    packaged = package / "conf"
    if packaged.is_dir():
        return str(packaged)
    return str(package.parents[1] / "conf")


def compose_config(config_name: str = "train", overrides: Sequence[str] = ()) -> DictConfig:
    """Compose a config of conf/ as the console scripts do (Hydra's compose API), the ``hydra`` node
    included. Hydra raises for unknown keys, groups and options.

    Composed as in a fresh process: composing merges configs, and a merge resolves the ``hydra`` node's
    interpolations when a job that ran earlier in this process (a notebook, a test) left Hydra's state
    set; ``hydra.run.dir``'s resolver would then reserve a run folder. That state is put back after."""
    with hydra_state(None), initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        return compose(config_name=config_name, overrides=list(overrides), return_hydra_config=True)


def compose_run_config(overrides: Sequence[str] = ()) -> DictConfig:
    """The training config as ``aiayn-train``'s job sees it, resolved: ``${hydra:...}`` interpolations
    are filled in from this composition's Hydra state, and the caller's state is put back; the ``hydra``
    node is removed."""
    cfg = compose_config("train", overrides)
    with hydra_state(cfg):
        with open_dict(cfg):
            del cfg["hydra"]
        OmegaConf.resolve(cfg)
    return cfg


def composed_run_dir(overrides: Sequence[str] = ()) -> Path:
    """The folder ``aiayn-train <overrides>`` would run in, chosen (and reserved) as its Hydra does."""
    cfg = compose_config("train", overrides)
    with hydra_state(cfg):
        return Path(OmegaConf.select(cfg, "hydra.run.dir"))


@contextmanager
def hydra_state(cfg: DictConfig | None) -> Iterator[None]:
    """Hydra's state set to the composed ``cfg`` (``${hydra:...}`` resolves from it; None: no state, as in
    a fresh process), the caller's put back."""
    state = HydraConfig.instance()
    earlier = state.cfg
    if cfg is None:
        state.cfg = None
    else:
        state.set_config(cfg)
    try:
        yield
    finally:
        state.cfg = earlier


# conf/train.yaml names these; registered on import, before any entry point composes its config.
OmegaConf.register_new_resolver("aiayn.experiment_name", experiment_name, replace=True)
OmegaConf.register_new_resolver("aiayn.output_root", output_root, replace=True)
OmegaConf.register_new_resolver("aiayn.sweep_dir", sweep_dir, replace=True)
OmegaConf.register_new_resolver("aiayn.cpu_precision", cpu_precision, replace=True)
# Cached: the folder is chosen once per run; Lightning reads it again when it starts the DDP ranks, and
# resume=true must not then pick another run's folder.
OmegaConf.register_new_resolver("aiayn.run_dir", run_dir, replace=True, use_cache=True)
# Cached too: Hydra copies the cache into each job's config, so that every job finds the multirun's folder.
OmegaConf.register_new_resolver("aiayn.multirun_dir", multirun_dir, replace=True, use_cache=True)
# Not cached: each job resolves its own folder, in the process that runs it.
OmegaConf.register_new_resolver("aiayn.job_dir", job_dir, replace=True)
