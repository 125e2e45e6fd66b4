"""The measurement harness: time, peak memory and quality of attention variants against sequence length."""
