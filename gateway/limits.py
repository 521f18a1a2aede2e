"""The gateway's request limits (--max-tools, --max-schema-bytes, --max-schema-depth):
declared in baton/request_limits.py, beside the gateway's other flags' configs."""
from baton.request_limits import RequestLimits, json_depth

__all__ = ["RequestLimits", "json_depth"]
