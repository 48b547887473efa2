"""Environments and tools for multi-turn RL: the interface, built-in environments, tool
calls, the multi-turn rollout driver and the trajectory store."""

from jaxrl_post.envs.arithmetic import ToolArithmetic
from jaxrl_post.envs.base import Environment, Episode, Step, play
from jaxrl_post.envs.chat import TurnFormat
from jaxrl_post.envs.code import HumanEvalFeedback
from jaxrl_post.envs.driver import EpisodeLimits, EpisodeRecord, EpisodeRunner
from jaxrl_post.envs.games import GuessingGame
from jaxrl_post.envs.tools import (MalformedCall, Tool, ToolCall, ToolRegistry, calculator,
                                   parse_tool_call, python_sandbox)

__all__ = ["Environment", "Episode", "EpisodeLimits", "EpisodeRecord", "EpisodeRunner", "GuessingGame",
           "HumanEvalFeedback", "MalformedCall", "Step", "Tool", "ToolArithmetic", "ToolCall",
           "ToolRegistry", "TurnFormat", "calculator", "parse_tool_call", "play",
           "python_sandbox"]
