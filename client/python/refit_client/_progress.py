"""A tqdm progress bar for push(): ``client.push(sd, progress="tqdm")``."""

from __future__ import annotations

from typing import Any, Optional

from .types import PushProgress


class TqdmProgress:
    """A push progress callback that draws a tqdm bar of the bytes sent, with
    the tensors done as its postfix. tqdm is optional: it is imported here,
    and its absence is an ImportError naming the package. Keyword arguments go
    to ``tqdm.tqdm`` (e.g. ``total=`` bytes, ``file=``, ``disable=``)."""

    def __init__(self, **tqdm_kwargs: Any) -> None:
        try:
            from tqdm import tqdm
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise ImportError("progress='tqdm' needs the tqdm package (pip install tqdm)") from e
        options = {"unit": "B", "unit_scale": True, "unit_divisor": 1024, "desc": "push"}
        options.update(tqdm_kwargs)
        self.bar = tqdm(**options)
        self._sent = 0

    def __call__(self, p: PushProgress) -> None:
        self.bar.update(p.bytes_sent - self._sent)
        self._sent = p.bytes_sent
        total: Optional[int] = p.tensors_total
        self.bar.set_postfix_str(
            f"{p.tensors_done}/{total} tensors" if total is not None else f"{p.tensors_done} tensors",
            refresh=False,
        )

    def close(self) -> None:
        self.bar.close()
