"""TR-HASH model: config, hash routing, routed experts, losses and the causal LM."""
from .config import TRHashConfig
from .routing import RouteTableError
from .transformer import TRHashForCausalLM, report_route_differences

__all__ = ["TRHashConfig", "TRHashForCausalLM", "RouteTableError", "report_route_differences"]
