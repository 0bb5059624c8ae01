"""Integrations with the RL stacks TLT plugs into (verl, SGLang); each imported only on demand."""
