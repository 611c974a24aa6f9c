"""Off-policy control: dis, icepop, staleness."""
