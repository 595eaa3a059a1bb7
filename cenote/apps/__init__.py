"""Applications built on the offline ``LLM``: corpus embedding jobs (``corpus``), OpenAI batch
files (``batch``) and Ray Data callables (``ray``). They sit above ``cenote.llm`` and the
server; nothing below imports them."""
