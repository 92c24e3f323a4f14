"""Reading model source: positions for errors, hint decorators as literals, the
header of generated files."""
