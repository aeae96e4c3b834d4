"""Emulators: a slower device on the same hardware (`slowdown`: padded steps, emulated
block compute) and exact single-process training under a schedule's weight versions
(`versions`). Training imports them for `plait train --cluster`; tests, benches and
experiments use them as references.

The submodules are imported by name (`plait.emulate.slowdown`): they need torch, and the
package itself stays free of it.
"""

from __future__ import annotations

__all__: list[str] = []
