"""What the notebook shows: timeline plots and trace files, tables, the dashboard."""
