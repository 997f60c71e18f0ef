"""`KernelConfig`: which implementation each op family runs (defined beside `ForwardContext` in
`sharding.context`, which carries it into every forward)."""

from sharding.context import KernelConfig

__all__ = ["KernelConfig"]
