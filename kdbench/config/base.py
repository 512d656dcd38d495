"""The base of every suite model: strict, frozen, no unknown keys."""

from pydantic import BaseModel, ConfigDict


class Strict(BaseModel):
    """Strict types (no silent coercion), frozen instances, and an error for any unknown key."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)
