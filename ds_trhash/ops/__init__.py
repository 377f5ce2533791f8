"""Operations around training runs: supervised long-running jobs (``ds-trhash jobs``)."""
