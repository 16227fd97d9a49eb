"""Hand-written captions and questions for the real photos available offline.

Sources: scikit-image's bundled images (``skimage.data``) and matplotlib's sample data.  Every
caption and question was written while looking at the image.  Texts avoid left/right and
exact-position claims, because samples are randomly cropped and (where allowed) mirrored.

``holdout`` names the only split in which a photo may appear; ``None`` means the photo's
*augmentations* are divided between the splits instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .core import QA


@dataclass(frozen=True)
class Photo:
    """One real photo with everything true about it.

    Attributes:
        name: identifier used in keys and metadata.
        source: ``"skimage:<function>"``, ``"skimage-stereo:<index>"`` or ``"mpl:<sample file>"``.
        captions: 2-4 one-sentence captions.
        detailed: a longer description.
        qas: questions whose answers survive cropping.
        min_scale: smallest crop (fraction of the full image side) that keeps the captions true.
        flip: whether a horizontal mirror keeps the texts true (no readable text, no sides).
        pad: letterbox instead of cropping to a square (wide pages, whole silhouettes).
        pad_color: colour of the letterbox bars; random when ``None``.
        jitter: whether brightness / contrast / saturation jitter keeps the texts true (not for
            graphics on a white background).
        holdout: ``"validation"`` / ``"test"`` to reserve the whole photo for that split.
    """

    name: str
    source: str
    captions: tuple[str, ...]
    detailed: str
    qas: tuple[QA, ...] = field(default=())
    min_scale: float = 0.7
    flip: bool = True
    pad: bool = False
    pad_color: tuple[int, int, int] | None = None
    jitter: bool = True
    holdout: str | None = None


COLOR_WORDS = ("Red", "Blue", "Green", "Orange", "White", "Black", "Yellow", "Brown")

PHOTOS: tuple[Photo, ...] = (
    Photo(
        "astronaut", "skimage:astronaut",
        ("A smiling astronaut in an orange spacesuit poses in front of an American flag.",
         "Portrait of a woman astronaut wearing an orange flight suit.",
         "An astronaut in an orange suit with a helmet and a model space shuttle nearby."),
        "A formal portrait of a smiling astronaut with short brown hair wearing an orange launch suit with "
        "mission patches. An American flag hangs behind her, a model of the space shuttle stands in the "
        "background, and a white helmet rests in front of her.",
        (QA("What color is the astronaut's suit?", "Orange", ("White", "Blue", "Green"), "photo.color"),
         QA("Is the person smiling?", "Yes", ("No",), "photo.yesno"),
         QA("What is this person's job?", "Astronaut", ("Doctor", "Pilot", "Chef"), "photo.what")),
        min_scale=0.85,
    ),
    Photo(
        "cameraman", "skimage:camera",
        ("A black and white photo of a man filming with a camera on a tripod.",
         "A man in a dark coat looks through a camera mounted on a tripod in a field.",
         "A cameraman stands on a grassy field with buildings in the distance."),
        "A black and white photograph of a man in a dark coat bending to look through a small camera on "
        "a tripod. He stands on a flat grassy field under a pale sky, with low buildings and a tall tower "
        "far in the background.",
        (QA("What is the man using?", "A camera on a tripod", ("A telescope", "A phone", "A bicycle"), "photo.what"),
         QA("Is this photo in color?", "No", ("Yes",), "photo.yesno"),
         QA("What is the camera standing on?", "A tripod", ("A table", "A chair", "The ground"), "photo.what")),
        min_scale=0.8,
    ),
    Photo(
        "cat", "skimage:chelsea",
        ("A close-up of a tabby cat with green eyes.",
         "The face of a brown striped cat looking to the side.",
         "A tabby cat with yellow-green eyes and a pink nose."),
        "A close-up photograph of a tabby cat's face. The cat has brown and black striped fur, large "
        "yellow-green eyes, long white whiskers and a pinkish nose, and the blurry background is light.",
        (QA("What animal is this?", "A cat", ("A dog", "A rabbit", "A fox"), "photo.what"),
         QA("What color are the cat's eyes?", "Green", ("Blue", "Brown", "Black"), "photo.color"),
         QA("Does the cat have stripes?", "Yes", ("No",), "photo.yesno")),
        min_scale=0.75,
    ),
    Photo(
        "coffee", "skimage:coffee",
        ("A cup of espresso on a red saucer on a wooden table.",
         "A red coffee cup with a spoon on its saucer.",
         "Espresso in a small red and white cup on a wooden table."),
        "Seen from above at an angle, a small cup with a red outside and a white inside holds espresso with "
        "a light brown crema. It sits on a matching red saucer with a metal spoon, on a worn wooden table.",
        (QA("What drink is in the cup?", "Coffee", ("Tea", "Milk", "Orange juice"), "photo.what"),
         QA("What color is the saucer?", "Red", ("Blue", "White", "Green"), "photo.color"),
         QA("What is the table made of?", "Wood", ("Glass", "Metal", "Stone"), "photo.what"),
         QA("What lies on the saucer next to the cup?", "A spoon", ("A fork", "A knife", "A cookie"), "photo.what")),
        min_scale=0.75,
    ),
    Photo(
        "coins", "skimage:coins",
        ("Rows of old silver coins on a dark background.",
         "A black and white photo of ancient coins arranged in a grid.",
         "A collection of ancient coins laid out in neat rows."),
        "A black and white photograph of a collection of ancient coins arranged in rows on a dark surface. "
        "Most coins show a head in profile or a standing figure, and they vary slightly in size.",
        (QA("What objects are shown?", "Coins", ("Buttons", "Cookies", "Stamps"), "photo.what"),
         QA("Are the objects arranged in rows?", "Yes", ("No",), "photo.yesno"),
         QA("Is this photo in color?", "No", ("Yes",), "photo.yesno")),
        min_scale=0.6,
    ),
    Photo(
        "deep_field", "skimage:hubble_deep_field",
        ("A deep space image full of distant galaxies.",
         "Hundreds of colorful galaxies scattered across a black sky.",
         "A telescope view of galaxies and stars against dark space."),
        "An astronomical image from a space telescope showing a dark sky densely filled with small galaxies. "
        "Some are spirals or ellipses glowing white, orange or blue, and most are tiny faint smudges.",
        (QA("What does this image show?", "Galaxies in space", ("Fireworks", "A city at night", "Snow"), "photo.what"),
         QA("What color is the background?", "Black", ("Blue", "White", "Gray"), "photo.color"),
         QA("Was this image taken with a telescope?", "Yes", ("No",), "photo.yesno")),
        min_scale=0.4,
    ),
    Photo(
        "tissue", "skimage:immunohistochemistry",
        ("A microscope image of stained tissue in brown and blue.",
         "Stained tissue under a microscope, with brown cell outlines and blue nuclei.",
         "A histology slide showing brown stained glands among pale blue cells."),
        "A microscope photograph of a tissue section stained for a protein. Groups of cells with brown-stained "
        "outlines form glands and clusters, surrounded by pale connective tissue dotted with small blue nuclei.",
        (QA("Is this a microscope image?", "Yes", ("No",), "photo.yesno"),
         QA("What are the two main colors in the image?", "Brown and blue", ("Red and green", "Black and white",
                                                                               "Yellow and purple"), "photo.color"),
         QA("What kind of image is this?", "A microscope image of tissue", ("A satellite photo", "A painting",
                                                                             "A map"), "photo.what")),
        min_scale=0.5,
    ),
    Photo(
        "moon", "skimage:moon",
        ("A black and white image of the moon's surface with craters.",
         "Gray lunar terrain dotted with small craters.",
         "A close view of the cratered surface of the Moon."),
        "A grayscale image of the surface of the Moon. The flat gray ground is dotted with small round "
        "craters, and a few darker rough patches stand out against it.",
        (QA("Is this image in color?", "No", ("Yes",), "photo.yesno"),
         QA("What surface is shown?", "The surface of the Moon", ("A beach", "A road", "A cloud"), "photo.what"),
         QA("What are the small round pits?", "Craters", ("Holes dug by people", "Lakes", "Trees"), "photo.what")),
        min_scale=0.6,
    ),
    Photo(
        "page", "skimage:page",
        ("A photo of a printed textbook page about image segmentation.",
         "A page of printed text with a heading and a line of code.",
         "Black and white text from a page of a book."),
        'A grayscale photo of a printed page. A heading reads "Region-based segmentation", followed by a '
        "paragraph about markers for coins and background and a line of Python code.",
        (QA("What kind of object is shown?", "A page of printed text", ("A painting", "A map", "A receipt"),
            "photo.what"),
         QA("Does the page contain writing?", "Yes", ("No",), "photo.yesno")),
        min_scale=0.9, flip=False, pad=True,
    ),
    Photo(
        "handwriting", "skimage:text",
        ("Handwritten math equations on a sheet of paper.",
         "A close-up of handwritten formulas in pencil on paper.",
         "A black and white photo of handwritten mathematics."),
        "A black and white close-up of a sheet of paper with handwritten mathematical expressions, "
        "photographed at a steep angle so part of the writing is blurred.",
        (QA("Is the writing handwritten or printed?", "Handwritten", ("Printed",), "photo.what"),
         QA("What is written on the paper?", "Math equations", ("A shopping list", "A poem", "A map"), "photo.what")),
        min_scale=0.9, flip=False, pad=True,
    ),
    Photo(
        "bricks", "skimage:brick",
        ("A black and white photo of a brick pavement.",
         "Rows of rectangular bricks laid in a staggered pattern.",
         "A close-up of a surface made of long gray bricks."),
        "A grayscale photograph of a surface made of long rectangular bricks laid in a staggered pattern, "
        "with light mortar lines between them, seen at a slight angle.",
        (QA("What material is shown?", "Brick", ("Wood", "Glass", "Grass"), "photo.what"),
         QA("Are the bricks arranged in a pattern?", "Yes", ("No",), "photo.yesno")),
        min_scale=0.4,
    ),
    Photo(
        "grass", "skimage:grass",
        ("A black and white close-up of grass.",
         "Grass and a few small leaves seen from above.",
         "A patch of lawn photographed in black and white."),
        "A grayscale photo looking down at a patch of lawn, with thin blades of grass and a few small "
        "leaves mixed in.",
        (QA("What is shown in this image?", "Grass", ("Sand", "Water", "Bricks"), "photo.what"),
         QA("Is this photo in color?", "No", ("Yes",), "photo.yesno")),
        min_scale=0.4,
    ),
    Photo(
        "gravel", "skimage:gravel",
        ("A black and white photo of gravel.",
         "A close-up of many small gray stones.",
         "A bed of small angular pebbles packed together."),
        "A grayscale close-up of a bed of gravel made of many small angular stones of similar size packed "
        "closely together.",
        (QA("What is shown in the image?", "Gravel", ("Grass", "Bricks", "Sand"), "photo.what"),
         QA("Are the stones large or small?", "Small", ("Large",), "photo.what")),
        min_scale=0.4,
    ),
    Photo(
        "logo", "skimage:logo",
        ("A round green and orange logo with a snake.",
         "A circular logo split into green and orange halves with a snake's head.",
         "The scikit-image logo, a green and orange circle with a snake."),
        "A round logo divided by a white S-shaped curve into a green part and an orange part. The halves "
        "are filled with close-up drawings of a snake's scaly head and body.",
        (QA("What animal appears in the logo?", "A snake", ("A cat", "A bird", "A fish"), "photo.what"),
         QA("What are the two main colors of the logo?", "Green and orange", ("Red and blue", "Black and white",
                                                                               "Purple and yellow"), "photo.color"),
         QA("What shape is the logo?", "A circle", ("A square", "A triangle", "A star"), "photo.what")),
        min_scale=0.95, flip=False, jitter=False,
    ),
    Photo(
        "horse", "skimage:horse",
        ("A black silhouette of a horse on a white background.",
         "The outline of a standing horse filled in black.",
         "A solid black horse shape against white."),
        "A solid black silhouette of a horse standing in profile on a plain white background, with its "
        "long tail hanging down and its head raised.",
        (QA("What animal is shown?", "A horse", ("A dog", "A cow", "A deer"), "photo.what"),
         QA("What color is the horse?", "Black", ("White", "Brown", "Gray"), "photo.color")),
        min_scale=0.9, pad=True, pad_color=(255, 255, 255), jitter=False, holdout="test",
    ),
    Photo(
        "motorcycle", "skimage-stereo:0",
        ("A red motorcycle parked in a garage.",
         "A red and black motorcycle standing on its kickstand in a workshop.",
         "A motorcycle with a red tank and a black seat in a cluttered garage."),
        "A red motorcycle with a black seat and a chrome engine is parked on a concrete floor inside a "
        "garage. Shelves with cardboard boxes and tools fill the background, and a wooden bench stands "
        "against the wall.",
        (QA("What vehicle is shown?", "A motorcycle", ("A bicycle", "A car", "A truck"), "photo.what"),
         QA("What color is the motorcycle?", "Red", ("Blue", "Black", "Green"), "photo.color"),
         QA("Is the motorcycle indoors or outdoors?", "Indoors", ("Outdoors",), "photo.what")),
        min_scale=0.85, pad=True, holdout="test",
    ),
    Photo(
        "grace_hopper", "mpl:grace_hopper.jpg",
        ("A portrait of Grace Hopper in a navy uniform in front of a flag.",
         "An elderly woman in a dark navy uniform and cap poses by an American flag.",
         "Official portrait of an older woman wearing glasses and a naval officer's uniform."),
        "A formal portrait of Rear Admiral Grace Hopper, an elderly woman with glasses, wearing a dark navy "
        "uniform with a white shirt, ribbons and an officer's cap with a gold emblem. An American flag "
        "hangs behind her against a blue background.",
        (QA("Is the person wearing glasses?", "Yes", ("No",), "photo.yesno"),
         QA("What kind of clothes is she wearing?", "A navy uniform", ("A sweater", "A summer dress",
                                                                        "A spacesuit"), "photo.what"),
         QA("What is on her head?", "An officer's cap", ("A helmet", "A crown", "Nothing"), "photo.what")),
        min_scale=0.8, flip=False,
    ),
    Photo(
        "gift", "mpl:Minduka_Present_Blue_Pack.png",
        ("A blue gift box tied with a silver ribbon and bow.",
         "A wrapped blue present with a shiny silver bow.",
         "An illustration of a blue gift box with a ribbon."),
        "An illustration of a blue gift box wrapped with a shiny silver ribbon that crosses the lid and ends "
        "in a bow on top, on a plain white background.",
        (QA("What color is the box?", "Blue", ("Red", "Green", "Yellow"), "photo.color"),
         QA("What is tied around the box?", "A silver ribbon", ("A rope", "A chain", "Nothing"), "photo.what"),
         QA("Is this a gift?", "Yes", ("No",), "photo.yesno")),
        min_scale=0.85, jitter=False, holdout="validation",
    ),
    Photo(
        "retina", "skimage:retina",
        ("A photo of the back of a human eye showing the retina.",
         "A retina image with orange-red tissue and branching blood vessels.",
         "A medical eye scan of a retina with red blood vessels."),
        "A medical fundus photograph of a human retina. The round orange-red image shows dark red blood "
        "vessels branching out from the bright yellow optic disc, with the darker macula near the middle, "
        "surrounded by a black border.",
        (QA("What part of the body is shown?", "The eye", ("The hand", "The heart", "The ear"), "photo.what"),
         QA("What are the branching red lines?", "Blood vessels", ("Cracks", "Roads", "Hairs"), "photo.what")),
        min_scale=0.8,
    ),
    Photo(
        "rocket", "skimage:rocket",
        ("A rocket on its launch pad at dusk.",
         "A white rocket standing between launch towers under a blue evening sky.",
         "A rocket ready for launch, lit by bright lights at twilight."),
        "A tall white rocket stands upright on a launch pad between metal lattice towers. The sky is deep "
        "blue at dusk, and bright lights near the ground glow like stars.",
        (QA("What vehicle is shown?", "A rocket", ("An airplane", "A train", "A ship"), "photo.what"),
         QA("Is it daytime or evening?", "Evening", ("Daytime",), "photo.what"),
         QA("What color is the rocket?", "White", ("Red", "Black", "Yellow"), "photo.color")),
        min_scale=0.75,
    ),
    Photo(
        "color_wheel", "skimage:colorwheel",
        ("A color wheel with rainbow hues on a black background.",
         "A circular color wheel fading to white at its center.",
         "A round chart of colors from red through green to blue."),
        "A circular color wheel on a black background. The hue changes around the circle through red, "
        "yellow, green, cyan, blue and magenta, and the colors fade to white at the center.",
        (QA("What shape is the color wheel?", "A circle", ("A square", "A triangle", "A star"), "photo.what"),
         QA("What color is at the center of the wheel?", "White", ("Black", "Red", "Blue"), "photo.color")),
        min_scale=0.9, flip=False, jitter=False,
    ),
    Photo(
        "cell", "skimage:cell",
        ("A grayscale microscope image of a single round cell.",
         "A bright round cell floating on a gray background.",
         "A microscope view of one cell in liquid."),
        "A grayscale microscope image of a single round cell floating in liquid. The cell looks like a "
        "bright disc with a dark halo, on an otherwise even gray background.",
        (QA("Is this a microscope image?", "Yes", ("No",), "photo.yesno"),
         QA("How many cells are visible?", "1", ("2", "3", "5"), "photo.count"),
         QA("What shape is the cell?", "Round", ("Square", "Triangular", "Star-shaped"), "photo.what")),
        min_scale=0.9,
    ),
)
