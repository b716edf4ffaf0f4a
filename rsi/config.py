"""Settings: environment variables with the prefix RSI_, resolved against RSI_HOME."""

from __future__ import annotations

import json
import os
import tomllib
from pathlib import Path

from pydantic import field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict
from sqlalchemy.engine import make_url


class Settings(BaseSettings):
    """Where rsi keeps its state. Unset URLs default to SQLite files inside ``home``."""

    model_config = SettingsConfigDict(env_prefix="RSI_", extra="ignore")

    home: Path = Path(".rsi")
    database_url: str | None = None
    mlflow_tracking_uri: str | None = None
    prefect_home: Path | None = None
    prefect_api_url: str | None = None  # a Prefect server (or Cloud workspace) API; unset: see prefect_api()
    engine_url: str | None = None  # a running OpenAI-compatible vLLM server; unset: rsi starts its own engine
    engine_api_key: str | None = None
    engine_model: str = "base"  # the name under which that server serves rsi's base model

    @field_validator("home")
    @classmethod
    def _absolute_home(cls, value: Path) -> Path:
        return value.expanduser().resolve()

    @property
    def db_url(self) -> str:
        return normalize_db_url(self.database_url or f"sqlite:///{self.home / 'rsi.db'}")

    @property
    def mlflow_uri(self) -> str:
        """RSI_MLFLOW_TRACKING_URI, else the MLflow server of a running ``rsi stack``, else SQLite in ``home``."""
        return (self.mlflow_tracking_uri or running_stack(self.home).get("mlflow_tracking_uri")
                or f"sqlite:///{self.home / 'mlflow.db'}")

    @property
    def prefect_dir(self) -> Path:
        return (self.prefect_home or self.home / "prefect").expanduser().resolve()

    def resolved(self, *, mask: bool = True) -> dict[str, str]:
        """The values in effect, with passwords masked unless asked otherwise."""
        show = mask_url if mask else str
        return {
            "home": str(self.home),
            "database_url": show(self.db_url),
            "mlflow_tracking_uri": show(self.mlflow_uri),
            "prefect_home": str(self.prefect_dir),
            "prefect_api_url": self.prefect_api() or "ephemeral (an embedded API under prefect_home)",
            "engine_url": self.engine_url or "managed (rsi engine start, in home/engine)",
            "engine_api_key": ("***" if mask else self.engine_api_key) if self.engine_api_key else "none",
        }

    def prefect_api(self) -> str | None:
        """The Prefect API rsi's flows report to: RSI_PREFECT_API_URL, else PREFECT_API_URL, else the server of
        a running ``rsi stack``, else the active Prefect profile's (PREFECT_PROFILE or the profiles file's
        ``active``); None: Prefect's ephemeral API, kept under ``prefect_home``."""
        if self.prefect_api_url or os.environ.get("PREFECT_API_URL"):
            return self.prefect_api_url or os.environ["PREFECT_API_URL"]
        stack_api = running_stack(self.home).get("prefect_api_url")
        if stack_api:
            return stack_api
        default = Path(os.environ.get("PREFECT_HOME", "~/.prefect")).expanduser() / "profiles.toml"
        path = Path(os.environ.get("PREFECT_PROFILES_PATH", default)).expanduser()
        try:
            profiles = tomllib.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
            return None  # no profiles file (or one Prefect itself would refuse): nothing configured
        active = os.environ.get("PREFECT_PROFILE") or profiles.get("active")
        profile = profiles.get("profiles", {}).get(active, {}) if isinstance(profiles.get("profiles"), dict) else {}
        url = profile.get("PREFECT_API_URL") if isinstance(profile, dict) else None
        return url if isinstance(url, str) and url else None

    def configure_prefect(self) -> None:
        """Point Prefect at the configured API and leave ``PREFECT_HOME`` alone; with none, keep Prefect's
        state (and its ephemeral API) in ``prefect_home``. Call before importing prefect."""
        url = self.prefect_api()
        if url:
            os.environ["PREFECT_API_URL"] = url
        else:
            os.environ.setdefault("PREFECT_HOME", str(self.prefect_dir))
            Path(os.environ["PREFECT_HOME"]).expanduser().mkdir(parents=True, exist_ok=True)


def stack_file(home: Path) -> Path:
    return Path(home) / "stack" / "stack.json"


def running_stack(home: Path) -> dict:
    """The URLs recorded by ``rsi stack up`` while every one of its server processes lives; else {}."""
    try:
        stack = json.loads(stack_file(home).read_text(encoding="utf-8"))
        pids = [int(s["pid"]) for s in stack["services"]]
    except (OSError, ValueError, KeyError, TypeError):
        return {}
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return {}
        except PermissionError:
            pass
    return stack


def normalize_db_url(url: str) -> str:
    """Use the psycopg 3 driver for a bare ``postgresql://`` URL (psycopg2 is not a dependency)."""
    if url.startswith("postgresql://") or url.startswith("postgres://"):
        return "postgresql+psycopg://" + url.split("://", 1)[1]
    return url


def mask_url(url: str) -> str:
    """Hide the password of a database URL; anything that is not a URL is returned as it is."""
    try:
        parsed = make_url(url)
    except Exception:
        return url
    if parsed.password is None:
        return url
    return parsed.render_as_string(hide_password=True)


def get_settings() -> Settings:
    return Settings()
