"""An alias of agentmw.sdk, the middleware SDK (docs/packaging.md).

The SDK lives in the core package ``agentmw`` so that ``pip install agentmw-sdk`` serves a
middleware without the host; this name stays because the built-in servers are run as
``python -m mw_servers.<name>`` and ``python -m mw_servers.sdk module:Class`` is the documented way
to serve a class from a full install. Same objects, not a copy: new code imports agentmw.sdk.
"""

from agentmw.sdk import *  # noqa: F403 - the whole public API, re-exported
from agentmw.sdk import __all__ as __all__
