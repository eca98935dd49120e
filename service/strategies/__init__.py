"""Strategy runtimes; importing this package registers the built-in kinds."""

from service.strategies import cstc as cstc
from service.strategies import dag as dag
from service.strategies import gating as gating
from service.strategies import greedy as greedy
from service.strategies import parsing as parsing
from service.strategies import polydom as polydom
from service.strategies import structured as structured

__all__ = ["cstc", "dag", "gating", "greedy", "parsing", "polydom", "structured"]
