"""The book's chapters: one folder per page, `book/05_credit.md` -> `chapters/credit/`.

A chapter's modules import `grpo_companion.core` and `grpo_companion.lm`, and modules of their
own folder, never another chapter's.
"""
