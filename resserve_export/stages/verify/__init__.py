"""The verify stage: checkpoint checks, linear-output NMSE and perplexity, the report."""
