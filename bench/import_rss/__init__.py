"""bench/run import_rss: the resident memory each of the plugin's dependencies adds."""
