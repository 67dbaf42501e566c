"""Writes sample_data/pages/*.png: three small scanned-looking "pages" of text (PIL's own font), the images
sample_data/pages.jsonl asks a vision-language model to transcribe (docs/vision.md).

    python sample_data/make_pages.py
"""
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

PAGES = {
    "memo": ["MEMO", "To: the night shift", "From: operations", "", "The batch queue now holds 12,000 rows.",
             "Please leave the GPUs idle after 23:00", "so the nightly job can start on time."],
    "receipt": ["CORNER BAKERY", "2 x sourdough loaf      9.00", "1 x rye bread           4.50",
                "3 x croissant           7.20", "", "TOTAL                  20.70", "Paid by card. Thank you!"],
    "table": ["Quarterly rows processed", "", "Quarter   Rows      Errors", "Q1        1,200,000   310",
              "Q2        1,450,000   122", "Q3        1,610,000    97", "Q4        1,980,000    45"],
}


def main() -> None:
    folder = Path(__file__).resolve().parent / "pages"
    folder.mkdir(exist_ok=True)
    font = ImageFont.load_default(size=18)
    for name, lines in PAGES.items():
        page = Image.new("L", (448, 280), color=255)
        draw = ImageDraw.Draw(page)
        for i, line in enumerate(lines):
            draw.text((24, 20 + 34 * i), line, fill=0, font=font)
        page.save(folder / f"{name}.png", optimize=True)


if __name__ == "__main__":
    main()
