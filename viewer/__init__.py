"""``gyre-view runs/<id>``: a local web page over a run folder and its processor log (read-only)."""
