"""One module per chapter: what the chapter computes, as functions with tests.

A chapter module imports `grpo_companion.core` and `grpo_companion.lm`, never another
chapter's module.
"""
