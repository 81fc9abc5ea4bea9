"""The mlx-lm releases mlx_streaming supports: the range pyproject.toml
states, read from the installed package's metadata, checked at import."""

from importlib import metadata
from typing import Optional

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name


def mlx_lm_range() -> Optional[str]:
    """The supported mlx-lm versions (``>=0.32,<0.33``), or None when the
    package runs from a checkout that was never installed."""
    try:
        requires = metadata.requires("mlx_streaming") or []
    except metadata.PackageNotFoundError:
        return None
    for line in requires:
        requirement = Requirement(line)
        if canonicalize_name(requirement.name) == "mlx-lm" and requirement.marker is None:
            # Lower bound first: ">=0.32.0,<0.33".
            return ",".join(sorted(map(str, requirement.specifier), key=lambda s: s[0] != ">"))
    return None


def check_mlx_lm(found: Optional[str] = None) -> None:
    """Raise a one-line ImportError when the installed mlx-lm (or
    ``found``) is outside the supported range."""
    supported = mlx_lm_range()
    if supported is None:
        return
    if found is None:
        try:
            found = metadata.version("mlx-lm")
        except metadata.PackageNotFoundError:
            raise ImportError(f"mlx_streaming needs mlx-lm {supported}: "
                              f"pip install 'mlx-lm{supported}'") from None
    if not SpecifierSet(supported).contains(found, prereleases=True):
        raise ImportError(f"mlx_streaming {metadata.version('mlx_streaming')} supports mlx-lm "
                          f"{supported}, not the installed {found}: "
                          f"pip install 'mlx-lm{supported}'")
