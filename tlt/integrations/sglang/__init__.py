"""TLT inside stock SGLang servers (GPU clusters). SGLang is imported only by the modules here."""
