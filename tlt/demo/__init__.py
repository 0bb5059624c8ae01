"""The embedded demo: everything ``tlt demo`` and the tests build here, none of it the product.

``job`` (the three-arm verl GRPO run behind ``tlt demo``), ``corpus`` (the synthetic arithmetic
prompts and responses), ``grpo_task`` (the demo's verl task files and rule-based reward),
and ``target_factory`` (``tlt make-target``: small real-architecture targets trained here). The
product lives beside this package: config, CLI, warm-up, the integrations.
"""
