"""archon.rl.samples, at its old path for one release: see archon.rl.logging.samples."""

from archon.rl.logging.samples import (  # noqa: F401 - at its old path for one release
    FIELDS,
    SAMPLES_DIR,
    TABLE_FILE,
    drop_tables_after,
    merge_rank_rows,
    read_table,
    recorded_steps,
    sample_rows,
    table_path,
    tracker_table,
    whole_groups,
    write_table,
)
