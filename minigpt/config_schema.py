"""Where the config schemas lived before ``minigpt.config``; kept so that code importing the old
name (bench, notebooks) still runs."""

from minigpt.config import *  # noqa: F403
from minigpt.config import __all__  # noqa: F401
