"""Small helpers every folder may use, with no knowledge of models or training: cache and project paths and
write-aside-then-move, report names claimed in order, argparse types, lazy package names, process groups,
padding to a multiple."""
