"""Tasks. Every module of this package that registers a Task (`@register_task`) is found by
`build_task`: adding a task is one module here plus one YAML under conf/task/."""

from marl_llm.tasks.base import TASKS, JointReward, Problem, Task, Turn, build_task, register_task

__all__ = ["TASKS", "JointReward", "Problem", "Task", "Turn", "build_task", "register_task"]
