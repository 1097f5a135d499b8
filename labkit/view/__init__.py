"""What the notebook shows: timeline plots, tables, the rank grid, the dashboard's parts (the app itself: labkit.widgets)."""
