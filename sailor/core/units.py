"""Units Sailor converts between, named once: everything inside is SI (seconds, bytes, $), and these
turn it into what people read (GiB) or what prices are quoted in ($ per hour)."""

GIB = 2**30  # bytes in a gibibyte (memory figures are shown in GiB)
HOUR_S = 3600.0  # seconds in an hour (prices are $/GPU-hour; a plan's cost is $/iteration)
