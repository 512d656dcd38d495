"""The base of every suite model: strict, frozen, no unknown keys; and the suite's one value type of its own."""

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict


class Strict(BaseModel):
    """Strict types (no silent coercion), frozen instances, and an error for any unknown key."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


def _fit_check_mode(v: Any) -> Any:
    if isinstance(v, bool) or v == "auto":
        return v
    raise ValueError(
        f"write true, false or auto (got {v!r}): true checks every cell, false none, auto skips the check of a "
        "cell whose timed loop was shorter than the fit check"
    )


# The suite's `fit_check`: true, false or auto (one line naming the three for anything else: a union's own errors
# would say "valid boolean" and "and 1 more problem")
FitCheck = Annotated[bool | Literal["auto"], BeforeValidator(_fit_check_mode)]
